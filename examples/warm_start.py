"""Where a start goes, process start -> first token: imports, the GGUF import, the first prefill and the
first decode step of CompiledGenerator on the bundled SmolLM2. By default it runs on the native decoder
(nothing to compile: building and probing it is part of the first token). With --compiled it runs the
compiled steps: run it twice, the first run compiles and saves them to the compile cache, the second
(a fresh process) loads them.

    .venv/bin/python examples/warm_start.py [--compiled [--no-compile-cache]] [--threads 2]

Times are the process's age at the end of each phase (from /proc, so the interpreter's own start is
counted), then Dynamo/inductor's own breakdown of the compile work (torch._dynamo.utils.compile_times).
"""
import os
import sys


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0-based at exec)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


phases = [("interpreter", process_age_s())]

import argparse  # noqa: E402

import torch  # noqa: E402

phases.append(("import torch", process_age_s()))
import torch_lowbit as tl  # noqa: E402
from torch_lowbit.eval.assets import smollm2_gguf  # noqa: E402

phases.append(("import torch_lowbit", process_age_s()))

p = argparse.ArgumentParser()
p.add_argument("--compiled", action="store_true", help="the compiled steps instead of the native decoder")
p.add_argument("--no-compile-cache", action="store_true", help="plain torch.compile (Dynamo traces every start)")
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)

model, tok = tl.from_gguf(str(smollm2_gguf()))
phases.append(("from_gguf (SmolLM2 Q4_1)", process_age_s()))
gen = tl.CompiledGenerator(model, max_cache_len=64, compile_cache=not args.no_compile_cache,
                           native=False if args.compiled else None)
ids = tok("The capital of France is", return_tensors="pt").input_ids


class Phases:
    """A streamer: the prompt is put before the prefill, then each new token as it comes."""

    names = ["generator ready (native decoder built and probed)" if not args.compiled else "generator ready",
             "first token (prefill step)", "second token (first decode step)"]

    def __init__(self):
        self.puts = 0

    def put(self, value):
        phases.append((self.names[self.puts], process_age_s()))
        self.puts += 1

    def end(self):
        pass


out = gen.generate(ids, 2, streamer=Phases())

route = "native decoder" if gen._native is not None else \
    f"compiled steps, compile cache {'off' if args.no_compile_cache else 'on'}"
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {route}")
print("| phase | process age s | phase s |\n|---|---:|---:|")
before = 0.0
for name, age in phases:
    print(f"| {name} | {age:.2f} | {age - before:.2f} |")
    before = age
for kind, step in gen.compiled_steps.items() if gen._native is None else ():
    print(f"{kind}: {'loaded from ' + str(step.loaded_from) if step.loaded_from else 'compiled, saved to ' + str(step.saved_to)}")
print("tokens:", out[0, ids.shape[1]:].tolist(), repr(tok.decode(out[0, ids.shape[1]:])))
from torch._dynamo.utils import compile_times  # noqa: E402

print(compile_times(repr="str", aggregate=True), file=sys.stderr)
