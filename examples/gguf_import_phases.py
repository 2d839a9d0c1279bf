"""Where a `from_gguf` start goes: imports, then the import's own parts (opening the file, the config
and empty model, the Linear layers' blocks, the tokenizer), then one eager forward for the first token.

    .venv/bin/python examples/gguf_import_phases.py [FILE.gguf] [--profile N]

FILE defaults to the bundled SmolLM2 Q4_1. Times are seconds of wall clock; the process age counts
the interpreter's own start (from /proc). --profile N prints cProfile's N costliest functions of
from_gguf (cumulative time).
"""
import os
import sys
import time


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


start_age = process_age_s()
import argparse  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402,F401  (from_gguf imports it; counted with the imports)

import torch_lowbit as tl  # noqa: E402
from torch_lowbit.io import gguf as gguf_io  # noqa: E402

imported_age = process_age_s()

p = argparse.ArgumentParser()
p.add_argument("file", nargs="?", help="a .gguf file (default: the bundled SmolLM2 Q4_1)")
p.add_argument("--profile", type=int, default=0, metavar="N")
args = p.parse_args()
if args.file is None:
    from torch_lowbit.eval.assets import smollm2_gguf
    args.file = str(smollm2_gguf())

# the parts of from_gguf, timed where the module calls them (whichever of these names it has)
spent: dict[str, float] = {}


def timed(owner, name: str, label: str) -> None:
    inner = getattr(owner, name, None)
    if inner is None:
        return

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0

    setattr(owner, name, classmethod(lambda cls, *a, **kw: wrapper(*a, **kw)) if isinstance(
        owner.__dict__.get(name), classmethod) else wrapper)


timed(gguf_io, "open_gguf", "open the file (GGUFReader)")
timed(gguf_io, "_skeleton", "config + empty model")
timed(tl.QuantLinear, "from_quantized", "QuantLinear.from_quantized")
timed(gguf_io, "gguf_tokenizer", "tokenizer")

profiler = None
if args.profile:
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
t0 = time.perf_counter()
model, tok = tl.from_gguf(args.file)
from_gguf_s = time.perf_counter() - t0
if profiler is not None:
    profiler.disable()
ids = tok("The capital of France is", return_tensors="pt").input_ids if tok is not None else torch.tensor([[1, 2, 3]])
t0 = time.perf_counter()
with torch.no_grad():
    first = int(model(ids).logits[0, -1].argmax())
forward_s = time.perf_counter() - t0

print(f"{os.path.basename(args.file)}: torch {torch.__version__}, {torch.get_num_threads()} threads")
print("| phase | s |\n|---|---:|")
print(f"| interpreter start | {start_age:.1f} |")
print(f"| imports (torch, transformers, torch_lowbit) | {imported_age - start_age:.1f} |")
print(f"| from_gguf | {from_gguf_s:.1f} |")
for label, s in spent.items():
    print(f"| - {label} | {s:.1f} |")
print(f"| first token (eager forward) | {forward_s:.1f} |")
print(f"| process start -> first token | {process_age_s():.1f} |")
print(f"first token: {first} {tok.decode([first])!r}" if tok is not None else f"first token: {first}")
if profiler is not None:
    import pstats
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(args.profile)
