import sys, torch
a = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])
print("same inputs:", all(torch.equal(a[k], b[k]) for k in ("lin_w", "lin_b", "x")))
ok = True
for fmt in ["q4_0", "iq4_nl", "int4_pc"]:
    ka = sorted(k for k in a if k.startswith(fmt + "/")); kb = sorted(k for k in b if k.startswith(fmt + "/"))
    r = a[ka[0]]
    bad = [k for k in ka if not torch.equal(r, a[k])] + ["arm:" + k for k in kb if not torch.equal(r, b[k])]
    ok &= not bad
    print(f"{fmt}: {len(ka)} x86 + {len(kb)} aarch64 outputs, all bit-identical: {not bad}", bad[:6],
          "" if not bad else f"max|d|={max((b[k[4:]] if k.startswith('arm:') else a[k]).sub(r).abs().max().item() for k in bad):.3e}")
print("CROSS-ARCH OK" if ok else "CROSS-ARCH DIFFERENCES")
