import torch, torch.nn as nn, traceback
import torch_lowbit as tl
from torch_lowbit.ops import cpu_extension
torch.manual_seed(0)
paths = list(cpu_extension().available_cpu_paths())
print("available_cpu_paths:", paths)
lin = nn.Linear(256, 40)
x = torch.randn(5, 256)
print("default layout for q4_0:", tl.QuantLinear.from_linear(lin, "q4_0").layout.name)
ok_all = True
for fmt in ["q4_0", "iq4_nl", "int4_pc"]:
    outs = {}
    for layout in ["lut4_i8_n16", "q4_4x4", "q4_8x8"]:
        try:
            q = tl.QuantLinear.from_linear(lin, fmt, layout=layout)
        except Exception:
            print(f"{fmt}/{layout}: from_linear FAILED"); traceback.print_exc(); ok_all = False; continue
        for p in paths:
            try:
                with tl.use_backend("cpu", path=p):
                    y = q(x)
                outs[(layout, p)] = y
            except Exception:
                print(f"{fmt}/{layout}/{p}: forward FAILED"); traceback.print_exc(); ok_all = False
    ref_key = next(iter(outs))
    ref = outs[ref_key]
    with tl.use_backend("reference"):
        yref = tl.QuantLinear.from_linear(lin, fmt, layout="lut4_i8_n16")(x)
    diffs = {f"{l}/{p}": ("equal" if torch.equal(y, ref) else f"DIFF max|d|={(y-ref).abs().max().item():.3e}") for (l, p), y in outs.items()}
    same = all(torch.equal(y, ref) for y in outs.values())
    ok_all &= same
    print(f"{fmt}: {len(outs)} (layout,path) outputs, all bit-identical to {ref_key}: {same}; "
          f"max|y-reference backend|={(ref-yref).abs().max().item():.3e}, |y| max={ref.abs().max().item():.3f}")
    for k, v in diffs.items():
        print(f"   {k}: {v}")
print("ALL OK" if ok_all else "SOME FAILURES")
