"""Build empty-ish aarch64 stand-ins for the CUDA runtime libraries the (CUDA) aarch64 torch wheel links
against (libcudart.so.13, libcublas.so.13, libcudnn.so.9, libnccl.so.2, ...), so that `import torch` can
load libtorch_cuda.so etc. on a machine without the NVIDIA pip packages.  Each stub has the right SONAME
and symbol version node and defines every symbol torch's libraries import from it: functions return 100
(cudaErrorNoDevice / CUDA_ERROR_NO_DEVICE), objects are 64 zero bytes.  No CUDA code path is usable."""
import glob, os, re, subprocess, sys
WHEEL, ROOT, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
RE = "aarch64-linux-gnu-readelf"
torch_libs = sorted(glob.glob(f"{WHEEL}/torch/lib/*.so*")) + glob.glob(f"{WHEEL}/torch/_C*.so")
sys_dirs = [f"{ROOT}/lib/aarch64-linux-gnu", f"{ROOT}/usr/lib/aarch64-linux-gnu", f"{ROOT}/lib", f"{WHEEL}/torch/lib"]
def present(name):
    return any(os.path.exists(os.path.join(d, name)) for d in sys_dirs)
def rd(args, f):
    return subprocess.run([RE, "-W"] + args + [f], capture_output=True, text=True).stdout
missing = set()
for f in torch_libs:
    for n in re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", rd(["-d"], f)):
        if not present(n):
            missing.add(n)
print("missing:", sorted(missing))
defined, versioned, unversioned = set(), {}, {}
sym_re = re.compile(r"^\s*\d+:\s+\S+\s+\S+\s+(\S+)\s+(\S+)\s+\S+\s+(\S+)\s+(\S+)")
def parse(f):
    out = []
    for line in rd(["--dyn-syms"], f).splitlines():
        m = sym_re.match(line)
        if m:
            typ, bind, ndx, name = m.groups()
            out.append((typ, bind, ndx, name))
    return out
sys_libs = [p for d in sys_dirs[:3] for p in glob.glob(f"{d}/*.so*")] + [f"{ROOT}/usr/bin/python3.11"]
for f in sys_libs + torch_libs:
    for typ, bind, ndx, name in parse(f):
        if ndx != "UND":
            defined.add(name.split("@")[0])
for f in torch_libs:
    # version name -> file, from the verneed section
    vmap, cur = {}, None
    for line in rd(["-V"], f).splitlines():
        m = re.search(r"File: (\S+)", line)
        if m: cur = m.group(1)
        m = re.search(r"Name: (\S+)\s+Flags", line)
        if m and cur: vmap[m.group(1)] = cur
    for typ, bind, ndx, name in parse(f):
        if ndx != "UND" or bind == "WEAK" or not name: continue
        base, _, ver = name.partition("@")
        ver = ver.split(" ")[0].lstrip("@")
        if ver:
            lib = vmap.get(ver)
            if lib in missing:
                versioned.setdefault(lib, {}).setdefault(ver, {})[base] = typ
        elif base not in defined:
            unversioned[base] = typ
print("unversioned orphans:", len(unversioned), sorted(unversioned)[:20])
os.makedirs(OUT, exist_ok=True)
for lib in sorted(missing):
    syms = {}  # name -> (type, version or None)
    for ver, d in versioned.get(lib, {}).items():
        for s, t in d.items(): syms[s] = (t, ver)
    for s, t in unversioned.items():  # unknown owner: every stub gets them (unversioned default)
        syms.setdefault(s, (t, None))
    asm = [".text"]
    for s, (t, v) in sorted(syms.items()):
        if t == "OBJECT":
            asm += [".data", f'.globl "{s}"', f'.type "{s}",%object', f'.size "{s}",64', f'"{s}":', ".zero 64", ".text"]
        elif t == "TLS":
            asm += [".section .tbss,\"awT\",%nobits", f'.globl "{s}"', f'.type "{s}",%tls_object', f'.size "{s}",64', f'"{s}":', ".zero 64", ".text"]
        else:
            asm += [f'.globl "{s}"', f'.type "{s}",%function', f'"{s}":', "mov w0, #100", "ret"]
    base = os.path.join(OUT, lib)
    open(base + ".s", "w").write("\n".join(asm) + "\n")
    vers = sorted({v for t, v in syms.values() if v})
    vs = ""
    for v in vers:
        names = [s for s, (t, vv) in syms.items() if vv == v]
        vs += v + " {\n  global:\n" + "".join(f'    "{n}";\n' for n in names) + "};\n"
    cmd = ["aarch64-linux-gnu-gcc", "-shared", "-nostdlib", "-o", base, base + ".s", f"-Wl,-soname,{lib}"]
    if vers:
        open(base + ".map", "w").write(vs)
        cmd.append(f"-Wl,--version-script={base}.map")
    subprocess.run(cmd, check=True)
    print(f"stub {lib}: {len(syms)} symbols, versions {vers}")
