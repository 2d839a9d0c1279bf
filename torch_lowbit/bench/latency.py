"""`python -m torch_lowbit bench latency`: every candidate format's measured forward latency on this
device at a model's module shapes (q/k/v and gate/up fused and alone, o, down), batch 1 and 16 by
default: the table latency-constrained MSQ reads (nn/latency.py; cached per device, so a later
MSQ(target_latency_ms=...) measures nothing)."""
from __future__ import annotations

import sys

from torch import nn

from ..formats import get_format
from ..nn.fusion import fusion_jobs, job_members
from ..nn.latency import device_key, layer_latencies
from ..nn.select import select_linears


def module_shapes(model: nn.Module) -> list[tuple[str, int, int]]:
    """(kind, N, K) of each distinct module shape of the model's blocks: fused groups and their
    layers alone ("q_proj+k_proj+v_proj", "k_proj", "o_proj", ...), in first-seen order."""
    targets = select_linears(model)
    seen: dict[tuple[str, int, int], None] = {}
    for job in fusion_jobs(model, targets, True):
        members = job_members(job)
        layers = [targets[f] for f in members]
        kind = "+".join(f.rpartition(".")[2] for f in members)
        seen[(kind, sum(m.out_features for m in layers), layers[0].in_features)] = None
        if len(members) > 1:
            for f, m in zip(members, layers):
                seen[(f.rpartition(".")[2], m.out_features, m.in_features)] = None
    out, shapes = [], set()
    for kind, n, k in seen:
        if (n, k) not in shapes:  # k_proj and v_proj share a shape: measured once
            shapes.add((n, k))
            out.append((kind, n, k))
    return out


def bench_latency(model: nn.Module, names, ms=(1, 16), device: str = "cpu", progress=None) -> tuple[list[str], list[list[str]]]:
    """(header, rows): µs per forward call, one row per (format, M), one column per module shape ('-'
    where the format cannot hold it)."""
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    shapes = module_shapes(model)
    header = ["format", "bits/weight", "M"] + [f"{kind} {n}x{k}" for kind, n, k in shapes]
    rows = []
    for name in names:
        fmt = get_format(name)
        cells = {m: [] for m in ms}
        for kind, n, k in shapes:
            if fmt.shape_problem(n, k) is not None:
                for m in ms:
                    cells[m].append("-")
                continue
            for m, s in layer_latencies(fmt, n, k, ms, device).items():
                cells[m].append(f"{s * 1e6:.1f}")
        for m in ms:
            rows.append([fmt.name, f"{fmt.bits_per_weight():g}", str(m)] + cells[m])
        progress(f"  {fmt.name}: done")
    return header, rows


def latency_title(device: str) -> str:
    return f"µs per forward call (median of 7 rounds over DRAM-sized copies); device key: {device_key(device)}"
