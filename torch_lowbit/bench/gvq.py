"""`bench gvq`: the general VQ formats' CPU kernels next to q4_0, and the codebook-cache ablation.

For each gvq format (quantized once from a Gaussian weight): the table kernel with the layout's
entries reordered by use (the default) and with the entries in a random order, the "direct" kernel
(every code's entry read from the whole codebook: VQ-LLM's shared-memory version) and the "decode"
route (rows dequantized to fp32 in memory, then a matmul: its element-wise global-memory version),
each on every CPU path asked for; q4_0 on the same paths. Weights are cycled through copies totalling
more than `rotate_mib` so each call streams them from DRAM; the contenders are timed in interleaved
rounds and each row is the median of its rounds' medians.
"""
from __future__ import annotations

import copy
import statistics
import sys
from typing import Optional

import torch

from ..formats import get_format
from ..layouts.gvq import chunk_major
from ..nn import QuantLinear
from ..ops import use_backend
from ..ops.gvq import gvq_kernel
from .cpu import _copies, _median_us
from .machine import active_path, check_paths

GVQ_BENCH_FORMATS = ("gvq4x8", "aqlm_2x8", "gptvq2")
GVQ_HEADERS = ["W (N x K)", "M", "threads", "format", "kernel", "entries", "path", "µs", "weight GB/s",
               "vs q4_0 (time ratio)"]


def _random_order(ql: QuantLinear, gen: torch.Generator) -> QuantLinear:
    """The same weight with every codebook's entries in a random order (the codes renumbered), packed
    without the layout's reorder: the ablation's "reorder off"."""
    fmt, lay = ql.fmt, ql.layout
    q = lay.unpack(fmt, ql.packed, ql.out_features, ql.in_features)
    codes, books = q["codes"].long(), q["codebooks"]
    regions, stages, entries, _ = books.shape
    perm = torch.stack([torch.stack([torch.randperm(entries, generator=gen) for _ in range(stages)])
                        for _ in range(regions)])  # new index -> old entry
    rank = torch.empty_like(perm).scatter_(2, perm, torch.arange(entries).expand_as(perm))
    from ..formats.gvq import region_index
    n, nv, _ = codes.shape
    region = region_index(*fmt.scope, n, nv * fmt.vec, torch.arange(n), torch.arange(nv) * fmt.vec)
    new_codes = torch.stack([rank[region, r, codes[..., r]] for r in range(stages)], -1)
    new_books = books.gather(2, perm[..., None].expand(-1, -1, -1, books.shape[3]))
    buffers = dict(ql.packed, codes=chunk_major(new_codes.reshape(n, -1), fmt.entries_log2, entries),
                   codebooks=new_books.transpose(2, 3).contiguous())
    out = QuantLinear(ql.in_features, ql.out_features, fmt, buffers, None, layout=lay)
    assert torch.equal(out.dequantize(), ql.dequantize())
    return out


@torch.no_grad()
def bench_gvq(shape=(4096, 4096), formats=GVQ_BENCH_FORMATS, ms=(1,), threads=(2,), paths=None,
              rotate_mib: int = 512, rounds: int = 3, progress=None) -> list[list[str]]:
    if progress is None:
        progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    paths = list(paths or [active_path()])
    check_paths(paths)
    n, k = shape
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
    contenders = []  # (format, kernel, entries order, modules)

    def copies_of(ql):
        return [ql] + [copy.deepcopy(ql) for _ in range(_copies(ql.weight_nbytes(), rotate_mib) - 1)]

    progress("quantizing q4_0")
    contenders.append(("q4_0", "-", "-", copies_of(QuantLinear.from_linear(lin, "q4_0"))))
    for name in formats:
        progress(f"quantizing {name} ({n}x{k}: k-means, a minute or more)")
        ql = QuantLinear.from_linear(lin, name)
        shuffled = _random_order(ql, gen)
        contenders += [(name, "tables", "by use", copies_of(ql)), (name, "tables", "random", copies_of(shuffled)),
                       (name, "direct", "by use", copies_of(ql)), (name, "decode", "by use", copies_of(ql))]
    saved = torch.get_num_threads()
    rows = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            for m in ms:
                x = torch.randn(m, k)
                times: dict = {}
                for r in range(rounds):
                    for fmt, kernel, order, mods in contenders:
                        for path in paths:
                            with use_backend("cpu", path=path), gvq_kernel(kernel if kernel != "-" else "tables"):
                                us = _median_us(lambda i: mods[i](x), len(mods))
                            times.setdefault((fmt, kernel, order, path), []).append(us)
                            progress(f"  M={m} threads={t} {fmt} {kernel} {order} {path} round {r + 1}: {us:.0f} us")
                for (fmt, kernel, order, path), ts in times.items():
                    us = statistics.median(ts)
                    mods = next(c[3] for c in contenders if c[:3] == (fmt, kernel, order))
                    base = statistics.median(times[("q4_0", "-", "-", path)])
                    rows.append([f"{n}x{k}", m, t, f"{fmt} ({get_format(fmt).storage_bits(n, k) / (n * k):.3f} bpw)",
                                 kernel, order, path, f"{us:.0f}", f"{mods[0].weight_nbytes() / (us * 1e3):.1f}",
                                 f"{us / base:.2f}"])
    finally:
        torch.set_num_threads(saved)
    return rows
