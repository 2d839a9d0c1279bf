# Same seeds on both machines -> same nn.Linear and x; saves the cpu-backend outputs of every (format, layout, path).
import sys, platform, torch, torch.nn as nn
import torch_lowbit as tl
from torch_lowbit.ops import cpu_extension
torch.manual_seed(0)
lin = nn.Linear(256, 40); x = torch.randn(5, 256)
if len(sys.argv) > 2:  # take the inputs from another machine's file (torch.randn differs across ISAs)
    src = torch.load(sys.argv[2]); x = src["x"]
    with torch.no_grad(): lin.weight.copy_(src["lin_w"]); lin.bias.copy_(src["lin_b"])
res = {"lin_w": lin.weight.detach().clone(), "lin_b": lin.bias.detach().clone(), "x": x}
layouts = ["lut4_i8_n16", "q4_4x4", "q4_8x8"]
for fmt in ["q4_0", "iq4_nl", "int4_pc"]:
    for layout in layouts:
        try:
            q = tl.QuantLinear.from_linear(lin, fmt, layout=layout)
        except Exception as e:
            print(f"{fmt}/{layout}: {type(e).__name__}: {e}"); continue
        for p in cpu_extension().available_cpu_paths():
            with tl.use_backend("cpu", path=p):
                res[f"{fmt}/{layout}/{p}"] = q(x)
torch.save(res, sys.argv[1]); print(platform.machine(), len(res), "tensors saved to", sys.argv[1])
