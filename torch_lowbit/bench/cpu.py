"""`python -m torch_lowbit bench cpu`: our CPU kernels side by side with PyTorch's own, weights
streamed from DRAM.

Each contender gets enough copies of its weight to total more than `rotate_mib` (default 512 MiB,
twice the largest L3 seen here: 260 MiB shared on the Xeon CI host) and cycles through them, so every
call reads its weight from DRAM. Times are medians. The roofline is the measured DRAM read bandwidth
(a large fp32 sum) divided into the bytes of each contender's weight.
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..formats import get_format
from ..layouts import default_layout, get_layout
from ..nn import QuantLinear


@dataclass
class Row:
    shape: str
    m: int
    threads: int
    name: str
    us: float
    weight_bytes: int

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
    from ..ops.library import cpu_extension
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
    """name -> (make(copy_index) -> (callable(x) -> y), weight bytes, activation dtype)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    out = {}
    for dtype, label in ((torch.float32, "torch fp32 F.linear"), (torch.bfloat16, "torch bf16 F.linear")):
        nbytes = w.numel() * torch.tensor([], dtype=dtype).element_size()
        ws = [w.to(dtype).clone() for _ in range(_copies(nbytes, rotate_mib))]
        out[label] = (lambda i, ws=ws: (lambda x: F.linear(x, ws[i])), nbytes, dtype, len(ws))
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
                nbytes, torch.bfloat16, len(reps))
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    for fmt in formats:
        for layout in layouts or [default_layout(get_format(fmt), "cpu").name]:
            if not get_layout(layout).supports(get_format(fmt)) or "cpu" not in get_layout(layout).backends:
                continue
            ql = QuantLinear.from_linear(lin, fmt, layout=layout)
            nbytes = ql.weight_nbytes()
            mods = [ql] + [copy.deepcopy(ql) for _ in range(_copies(nbytes, rotate_mib) - 1)]
            act = "int8 act" if "_i8_" in layout else "fp32 act"
            out[f"torch_lowbit {fmt} [{layout}, {act}]"] = (lambda i, mods=mods: mods[i], nbytes, torch.float32,
                                                             len(mods))
    return out


@torch.no_grad()
def bench_cpu(shapes=((4096, 4096),), ms=(1, 8, 64, 512), threads=(1, 2),
              formats=("q4_0", "iq4_nl", "int4_g32", "int4_g128"), layouts=None,
              rotate_mib: int = 512, progress=None) -> tuple[list[Row], float]:
    """Returns the rows (one per shape x M x threads x contender) and the DRAM read GB/s."""
    if progress is None:
        progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
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
                    for name, (make, nbytes, dtype, copies) in contenders.items():
                        x = torch.randn(m, k).to(dtype)
                        us = _median_us(lambda i: make(i)(x), copies)
                        rows.append(Row(f"{n}x{k}", m, t, name, us, nbytes))
                        progress(f"  {n}x{k} M={m} threads={t} {name}: {us:.0f} us")
    finally:
        torch.set_num_threads(saved_threads)
    return rows, bw


def format_table(rows: list[Row], bw: float) -> str:
    lines = [f"DRAM read bandwidth (measured): {bw:.1f} GB/s", "",
             "| W (N x K) | M | threads | kernel | µs | GFLOPS | weight GB/s | % of DRAM roofline | vs aten int4 g32 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n, k = map(int, r.shape.split("x"))
        base = next((b for b in rows if b.shape == r.shape and b.m == r.m and b.threads == r.threads
                     and b.name.startswith("aten int4pack g32")), None)
        ratio = f"{base.us / r.us:.2f}x" if base else "-"
        roof = 100 * r.weight_gbs() / bw
        lines.append(f"| {r.shape} | {r.m} | {r.threads} | {r.name} | {r.us:.0f} | {r.gflops(n, k):.1f} | "
                     f"{r.weight_gbs():.1f} | {roof:.0f}% | {ratio} |")
    return "\n".join(lines)


@torch.no_grad()
def bench_decode(formats=("q4_0",), new_tokens: int = 32, progress=None) -> list[list[str]]:
    """End-to-end SmolLM2 greedy decode tokens/s (batch 1): fp32, bf16 and each format (RTN), with
    the LM head float and quantized."""
    from ..eval import load_smollm2
    from ..eval.speed import decode_tokens_per_s, model_nbytes
    from ..nn import quantize_
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
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
        tps = decode_tokens_per_s(m, tok, new_tokens=new_tokens, repeats=5)
        rows.append([label, f"{model_nbytes(m)['linear'] / 1e6:.1f}", f"{tps:.1f}"])
        progress(f"  decode {label}: {tps:.1f} tok/s")
    fp32 = float(rows[0][2])
    for r in rows:
        r.append(f"{float(r[2]) / fp32:.2f}x")
    return rows
