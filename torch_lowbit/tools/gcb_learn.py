"""Learning group-codebook (gcb) tables from a model's weights (the algorithm: torch_lowbit/formats/gcb.py).

A tool, not format math: the format only loads tables (shipped or written by `gcb-learn`).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import Tensor

from ..core.packing import GCB_CODE_BITS
from ..formats.gcb import SUBGROUP, table_key

HIST_BINS = 16  # bins of the normalized-histogram shape features (phase 1)


def _kmeans(points: Tensor, k: int, gen: torch.Generator, iters: int, init: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Lloyd's k-means (k-means++ start unless `init`); returns (centroids [k, D], labels [P])."""
    if init is None:
        centroids = points[torch.randint(0, points.shape[0], (1,), generator=gen)]
        for _ in range(1, k):
            d2 = torch.cdist(points, centroids).amin(1) ** 2
            pick = torch.multinomial(d2 / d2.sum() if d2.sum() > 0 else torch.ones_like(d2), 1, generator=gen)
            centroids = torch.cat([centroids, points[pick]])
    else:
        centroids = init.clone()
    for _ in range(iters):
        labels = torch.cdist(points, centroids).argmin(1)
        sums = torch.zeros_like(centroids).index_add_(0, labels, points)
        counts = torch.bincount(labels, minlength=k).to(points.dtype)[:, None]
        centroids = torch.where(counts > 0, sums / counts.clamp_min(1), centroids)
    return centroids, torch.cdist(points, centroids).argmin(1)


def normalized_subgroups(weights: Iterable[Tensor], max_groups: int, gen: torch.Generator) -> Tensor:
    """fp64 [G, 32]: sub-groups of the weights, each divided by its absmax (all-zero ones dropped),
    a fixed-seed sample of at most max_groups."""
    groups = torch.cat([w.detach().double().reshape(-1, SUBGROUP) for w in weights if w.shape[-1] % SUBGROUP == 0])
    amax = groups.abs().amax(1, keepdim=True)
    groups = groups[amax[:, 0] > 0] / amax[amax[:, 0] > 0]
    if groups.shape[0] > max_groups:
        groups = groups[torch.randperm(groups.shape[0], generator=gen)[:max_groups]]
    return groups


def learn_codebooks(weights: Iterable[Tensor], bits: int, count: int = 16, max_groups: int = 200_000,
                    seed: int = 0) -> Tensor:
    """int8 [count, 2^bits] codebooks (each sorted) learned from weight matrices (see module doc)."""
    if bits not in GCB_CODE_BITS or count not in (4, 8, 16):
        raise ValueError(f"gcb-learn: bits must be {' or '.join(map(str, GCB_CODE_BITS))} and count 4, 8 or 16, "
                         f"got bits={bits} count={count}")
    gen = torch.Generator().manual_seed(seed)
    groups = normalized_subgroups(weights, max_groups, gen)
    if groups.shape[0] < count * 4:
        raise ValueError(f"gcb-learn: only {groups.shape[0]} usable sub-groups of {SUBGROUP}; give more weights")
    bins = ((groups + 1) / 2 * HIST_BINS).long().clamp_(0, HIST_BINS - 1)
    hist = torch.zeros(groups.shape[0], HIST_BINS, dtype=torch.float64).scatter_add_(
        1, bins, torch.ones_like(groups)) / SUBGROUP
    _, shape = _kmeans(hist, count, gen, iters=25)  # phase 1: distribution shapes
    entries = 2 ** bits
    tables = []
    for c in range(count):
        members = groups[shape == c].reshape(-1, 1)
        if members.shape[0] < entries:  # an empty shape: fall back to all values
            members = groups.reshape(-1, 1)
        q = torch.linspace(0.5 / entries, 1 - 0.5 / entries, entries, dtype=torch.float64)
        init = torch.quantile(members[:200_000, 0], q)[:, None]
        centroids, _ = _kmeans(members, entries, gen, iters=30, init=init)  # phase 2: values in the shape
        tables.append(_distinct_int8(torch.sort(centroids[:, 0]).values))
    return torch.stack(tables)


def _distinct_int8(levels: Tensor) -> Tensor:
    """Sorted fp centroids in [-1, 1] -> strictly increasing int8 levels (round(127 x), ties pushed apart)."""
    q = torch.round(levels * 127).clamp(-127, 127).to(torch.int64)
    for i in range(1, q.numel()):
        if q[i] <= q[i - 1]:
            q[i] = q[i - 1] + 1
    for i in range(q.numel() - 2, -1, -1):  # overflow at the top: push down
        if q[i] >= q[i + 1]:
            q[i] = q[i + 1] - 1
    return q.to(torch.int8)


def learn_smollm2_codebooks(count: int = 16, seed: int = 0) -> dict[str, Tensor]:
    """The shipped tables: learned on SmolLM2-135M's linear layers (attention + MLP)."""
    from ..eval.assets import load_smollm2

    model, _ = load_smollm2()
    weights = [m.weight for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
    return {table_key("smollm2", b): learn_codebooks(weights, b, count, seed=seed) for b in GCB_CODE_BITS}
