"""`python -m torch_lowbit bench cpu`: our CPU kernels side by side with PyTorch's own, weights
streamed from DRAM.

Each contender gets enough copies of its weight to total more than `rotate_mib` (default 512 MiB,
twice the largest L3 seen here: 260 MiB shared on the Xeon CI host) and cycles through them, so every
call reads its weight from DRAM. Times are medians. The roofline is the measured DRAM read bandwidth
(a large fp32 sum) divided into the bytes of each contender's weight.

`paths` times each torch_lowbit kernel once per CPU ISA path (avx512, avxvnni, avx2, scalar: the ones
this CPU has), side by side on one machine; PyTorch's contenders run once.
"""
from __future__ import annotations

import contextlib
import copy
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..formats import get_format
from ..layouts import default_layout, get_layout
from ..nn import ActQuantLinear, QuantLinear
from ..ops import use_backend
from .machine import active_path, check_paths


@dataclass
class Row:
    shape: str
    m: int
    threads: int
    name: str
    us: float
    weight_bytes: int
    path: str = "-"  # a torch_lowbit kernel's CPU ISA path; "any": plain torch, one code for every path;
    #                  "-": PyTorch's own contenders
    fmt: str = ""  # torch_lowbit rows: the format and layout
    layout: str = ""

    def gflops(self, n: int, k: int) -> float:
        return 2.0 * self.m * n * k / (self.us * 1e3)

    def weight_gbs(self) -> float:
        return self.weight_bytes / (self.us * 1e3)


def _median_us(fn: Callable[[int], object], copies: int, min_time: float = 0.3, min_iters: int = 5) -> float:
    fn(0)  # warm-up
    times, i, t_start = [], 0, time.perf_counter()
    while i < min_iters or time.perf_counter() - t_start < min_time:
        t0 = time.perf_counter()
        fn(i % copies)
        times.append(time.perf_counter() - t0)
        i += 1
        if i > 2000:
            break
    return statistics.median(times) * 1e6


def dram_read_gbs(mib: int = 512, repeats: int = 7) -> float:
    """Measured read bandwidth with the current thread count: all threads stream (XOR) a buffer far
    larger than the caches with wide loads (csrc/common/bandwidth.cpp); best of `repeats`."""
    from ..ops import cpu_extension
    probe = cpu_extension().read_probe
    buf = torch.randint(0, 2**62, (mib * 2**20 // 8,), dtype=torch.int64)
    probe(buf)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        probe(buf)
        times.append(time.perf_counter() - t0)
    return buf.numel() * 8 / min(times) / 1e9


def _copies(nbytes: int, rotate_mib: int) -> int:
    return max(2, -(-rotate_mib * 2**20 // max(nbytes, 1)))


def _contenders(n: int, k: int, formats: list[str], rotate_mib: int, layouts: list[str]):
    """name -> (make(copy_index) -> (callable(x) -> y), weight bytes, activation dtype, copies, format,
    layout); format and layout are "" for PyTorch's contenders."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    out = {}
    for dtype, label in ((torch.float32, "torch fp32 F.linear"), (torch.bfloat16, "torch bf16 F.linear")):
        nbytes = w.numel() * torch.tensor([], dtype=dtype).element_size()
        ws = [w.to(dtype).clone() for _ in range(_copies(nbytes, rotate_mib))]
        out[label] = (lambda i, ws=ws: (lambda x: F.linear(x, ws[i])), nbytes, dtype, len(ws), "", "")
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        for g in (32, 128):
            if k % g:
                continue
            q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
            sz = torch.randn(k // g, n, 2, generator=gen).to(torch.bfloat16) * 0.01
            nbytes = packed.numel() + sz.numel() * 2
            reps = [(packed.clone(), sz.clone()) for _ in range(_copies(nbytes, rotate_mib))]
            out[f"aten int4pack g{g} (bf16)"] = (
                lambda i, reps=reps, g=g: (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, reps[i][0], g, reps[i][1])),
                nbytes, torch.bfloat16, len(reps), "", "")
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    for spec in formats:
        fmt, act_bits, act_block = split_act_suffix(spec)
        for layout in layouts or [default_layout(get_format(fmt), "cpu").name]:
            if not get_layout(layout).supports(get_format(fmt)) or "cpu" not in get_layout(layout).backends:
                continue
            ql = QuantLinear.from_linear(lin, fmt, layout=layout)
            nbytes = ql.weight_nbytes()
            act = "int8 act" if "_i8_" in layout else "fp32 act"
            if act_bits:  # per-token (per-block) integer activations, rounded in the kernel where the layout can
                ql = ActQuantLinear(ql, act_bits, clip_ratio=0.9, block=act_block)
                act = act_label(act_bits, act_block)
            mods = [ql] + [copy.deepcopy(ql) for _ in range(_copies(nbytes, rotate_mib) - 1)]
            out[f"torch_lowbit {spec} [{layout}, {act}]"] = (lambda i, mods=mods: mods[i], nbytes, torch.float32,
                                                              len(mods), spec, layout)
    return out


def split_act_suffix(spec: str) -> tuple[str, int, int]:
    """'q4_0+a8' -> ('q4_0', 8, 0): a weight format with QuaRot-style per-token activations; 'q4_0+a4b16'
    -> ('q4_0', 4, 16): with one activation scale per block of 16 features; 'q4_0' -> ('q4_0', 0, 0)."""
    fmt, sep, act = spec.rpartition("+a")
    m = re.fullmatch(r"(\d+)(?:b(\d+))?", act) if sep else None
    if m:
        return fmt, int(m.group(1)), int(m.group(2) or 0)
    return spec, 0, 0


def act_label(bits: int, block: int) -> str:
    return f"int{bits} act, blocks of {block}" if block else f"int{bits} per-token act"


def _forcing(paths: list[str]):
    """(path, context manager factory that runs the kernels on it) for each path."""
    return [(p, lambda p=p: use_backend("cpu", path=p)) for p in paths]


def _path_runs(layout: str, paths: list[str]):
    """(row path, context forcing it) for each run of one contender: PyTorch's run once ("-"), as do
    layouts whose CPU code is plain torch, the same on every path ("any")."""
    if not layout:
        return [("-", contextlib.nullcontext)]
    if not get_layout(layout).isa_paths:
        return [("any", contextlib.nullcontext)]
    return _forcing(paths)


@torch.no_grad()
def bench_cpu(shapes=((4096, 4096),), ms=(1, 8, 64, 512), threads=(1, 2),
              formats=("q4_0", "iq4_nl", "int4_g32", "int4_g128"), layouts=None,
              rotate_mib: int = 512, paths=None, progress=None, rounds: int = 1) -> tuple[list[Row], float]:
    """Returns the rows (one per shape x M x threads x contender x path) and the DRAM read GB/s.
    paths: the CPU ISA paths to time each torch_lowbit kernel on (default: the active one). rounds > 1:
    every contender of a shape, M and thread count is timed once per round, the rounds one after the
    other (A B C, A B C, ...), and a row is the median of its rounds' medians: the ratios then compare
    timings taken in the same seconds, not minutes apart on a host whose bandwidth drifts."""
    if progress is None:
        progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    paths = list(paths or [active_path()])
    check_paths(paths)
    rows = []
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(max(threads))
    bw = dram_read_gbs(mib=max(64, 2 * rotate_mib))
    try:
        for n, k in shapes:  # shape given as (out N, in K)
            contenders = _contenders(n, k, list(formats), rotate_mib, list(layouts or []))
            for t in threads:
                torch.set_num_threads(t)
                for m in ms:
                    timed: dict = {}  # label -> (times of the rounds, the row's other fields)
                    for r in range(rounds):
                        for name, (make, nbytes, dtype, copies, fmt, layout) in contenders.items():
                            x = torch.randn(m, k).to(dtype)
                            for path, forced in _path_runs(layout, paths):
                                with forced():  # use_backend puts the previous path back, also on errors
                                    us = _median_us(lambda i: make(i)(x), copies)
                                label = name if path in ("-", "any") else f"{name} {path}"
                                timed.setdefault(label, ([], (nbytes, path, fmt, layout)))[0].append(us)
                                progress(f"  {n}x{k} M={m} threads={t} {label}"
                                         f"{f' round {r + 1}/{rounds}' if rounds > 1 else ''}: {us:.0f} us")
                    for label, (times, (nbytes, path, fmt, layout)) in timed.items():
                        rows.append(Row(f"{n}x{k}", m, t, label, statistics.median(times), nbytes, path, fmt, layout))
    finally:
        torch.set_num_threads(saved_threads)
    return rows, bw


def _q4_0_base(r: Row, rows: list[Row]):
    """The q4_0 row `r` is measured against: same shape, M and threads; for a torch_lowbit kernel on
    a path, q4_0 on that path, in r's layout where q4_0 has it, else q4_0's first layout; for the
    others, the first q4_0 row (the first path asked for)."""
    same = [b for b in rows if b.fmt == "q4_0" and b.shape == r.shape and b.m == r.m and b.threads == r.threads]
    if r.path not in ("-", "any"):
        same = [b for b in same if b.path == r.path] or same
        return next((b for b in same if b.layout == r.layout), same[0] if same else None)
    return same[0] if same else None


def format_table(rows: list[Row], bw: float, machine: str = "") -> str:
    """Markdown table; `machine`: a first line naming the CPU, ISA path, date and commit
    (machine.machine_line()). "vs q4_0": only when q4_0 was timed."""
    with_q4_0 = any(r.fmt == "q4_0" for r in rows)
    lines = ([machine] if machine else []) + [f"DRAM read bandwidth (measured): {bw:.1f} GB/s", "",
             "| W (N x K) | M | threads | kernel | path | µs | GFLOPS | weight GB/s | % of DRAM roofline | "
             "vs aten int4 g32 |" + (" vs q4_0 |" if with_q4_0 else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if with_q4_0 else "")]
    for r in rows:
        n, k = map(int, r.shape.split("x"))
        base = next((b for b in rows if b.shape == r.shape and b.m == r.m and b.threads == r.threads
                     and b.name.startswith("aten int4pack g32")), None)
        ratio = f"{base.us / r.us:.2f}x" if base else "-"
        roof = 100 * r.weight_gbs() / bw
        line = (f"| {r.shape} | {r.m} | {r.threads} | {r.name} | {r.path} | {r.us:.0f} | {r.gflops(n, k):.1f} | "
                f"{r.weight_gbs():.1f} | {roof:.0f}% | {ratio} |")
        if with_q4_0:
            q = _q4_0_base(r, rows)
            line += f" {q.us / r.us:.2f}x |" if q else " - |"
        lines.append(line)
    return "\n".join(lines)


def _model_runs(label: str, paths: list[str]):
    """Float models run once ("-"); quantized ones once per path."""
    return [("-", contextlib.nullcontext)] if label in ("fp32", "bf16") else _forcing(paths)


@torch.no_grad()
def bench_decode(formats=("q4_0",), new_tokens: int = 32, paths=None, progress=None) -> list[list[str]]:
    """End-to-end SmolLM2 greedy decode tokens/s (batch 1): fp32, bf16 and each format (RTN), with
    the LM head float and quantized, the quantized models on each of `paths` (default: the active
    one). Rows: [model, path, linear weights MB, tok/s, vs fp32]."""
    from ..eval import load_smollm2
    from ..eval.speed import decode_tokens_per_s, model_nbytes
    from ..nn import quantize_
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    paths = list(paths or [active_path()])
    check_paths(paths)
    model, tok = load_smollm2()
    rows = []
    for label in ["fp32", "bf16", *formats, *(f"{f} +lm_head" for f in formats)]:
        if label == "bf16":
            m = copy.deepcopy(model).to(torch.bfloat16)
        elif label == "fp32":
            m = model
        else:
            fmt, _, head = label.partition(" +")
            m = quantize_(copy.deepcopy(model), fmt, include_lm_head=bool(head), progress=False)
        for path, forced in _model_runs(label, paths):
            with forced():
                tps = decode_tokens_per_s(m, tok, new_tokens=new_tokens, repeats=5)
            rows.append([label, path, f"{model_nbytes(m)['linear'] / 1e6:.1f}", f"{tps:.1f}"])
            progress(f"  decode {label} {path}: {tps:.1f} tok/s")
    fp32 = float(rows[0][3])
    for r in rows:
        r.append(f"{float(r[3]) / fp32:.2f}x")
    return rows


@torch.no_grad()
def bench_prefill(formats=("q4_0",), threads=(1, 2), prompt_tokens: int = 128, repeats: int = 5, paths=None,
                  progress=None) -> list[list[str]]:
    """SmolLM2 prefill tokens/s: one eager forward pass over a `prompt_tokens`-token Wikipedia prompt
    (median of `repeats`), at each thread count, fp32 and each format (RTN), the quantized models on
    each of `paths` (default: the active one). Rows, by thread count: [threads, model, path, linear
    weights MB, prefill tok/s, vs fp32 at those threads]."""
    from ..eval import load_smollm2
    from ..eval.speed import model_nbytes, prefill_tokens_per_s, prompt_ids
    from ..nn import quantize_
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    paths = list(paths or [active_path()])
    check_paths(paths)
    model, tok = load_smollm2()
    ids = prompt_ids(tok, prompt_tokens)
    results = []  # (threads, label, path, MB, tok/s); one quantized model in memory at a time
    saved_threads = torch.get_num_threads()
    try:
        for label in ["fp32", *formats]:
            m = model if label == "fp32" else quantize_(copy.deepcopy(model), label, progress=False)
            mb = model_nbytes(m)["linear"] / 1e6
            for t in threads:
                torch.set_num_threads(t)
                for path, forced in _model_runs(label, paths):
                    with forced():
                        tps = prefill_tokens_per_s(m, ids, repeats=repeats)
                    results.append((t, label, path, mb, tps))
                    progress(f"  prefill {label} {path} threads={t}: {tps:.1f} tok/s")
            del m
    finally:
        torch.set_num_threads(saved_threads)
    fp32 = {t: tps for t, label, _, _, tps in results if label == "fp32"}
    return [[str(t), label, path, f"{mb:.1f}", f"{tps:.1f}", f"{tps / fp32[t]:.2f}x"]
            for t, label, path, mb, tps in sorted(results, key=lambda r: r[0])]
