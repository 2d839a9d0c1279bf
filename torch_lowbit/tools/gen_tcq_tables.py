"""Generates the 2-D tables of the TCQ hybrid ("quantlut_sym") code: torch_lowbit/formats/data/tcq_tables.safetensors.

    python -m torch_lowbit.tools.gen_tcq_tables --out DIR [--table-bits 9 10 11]

The fit follows QTIP (lib/codebook/bitshift.py, decode_mode 'quantlut_sym'): 2**Q centers drawn
from N(0, I) initialize a Lloyd k-means on 2**20 samples of a 2-D standard Gaussian, run until the
mean Euclidean distance to the nearest center drops by no more than 1e-5 in an iteration (the rule
of scipy.cluster.vq.kmeans, which QTIP calls); the centers are then rescaled to a standard deviation
(over all 2*2**Q numbers) of sqrt(15/16) = 0.9682458365518543. Differences from QTIP, both for
reproducibility: fixed seeds (QTIP draws from the global RNG) and a center that loses all its points
keeps its position (scipy drops it, which would change the table size).

Bit-exact on any machine and thread count: assignments are exact fp64 nearest-center searches (ties
to the lowest index), and every reduction whose order could depend on threading goes through
torch.bincount, a sequential loop.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch import Tensor

from ..formats.tcq import table_key

SAMPLES = 1 << 20
SEED_BASE = 20250  # seed of the Q-bit table: SEED_BASE + Q
TARGET_STD = math.sqrt(15 / 16)  # QTIP's 0.9682458365518543
STOP_DECREASE = 1e-5  # scipy.cluster.vq.kmeans's default thresh
MAX_ITERATIONS = 1000
TABLE_BITS = (9, 10, 11)
FILE_NAME = "tcq_tables.safetensors"

_GRID = 64  # cells per axis of the candidate-pruning grid
_GRID_RADIUS = 6.0  # grid spans [-R, R]^2; points outside fall into border cells
_FAR = 1e30  # coordinate of padding centers and points: never nearest
_BLOCK = 64  # points per block of the blocked layout


class _GridAssigner:
    """Exact nearest-center search for fixed 2-D points, pruned by a grid.

    For each grid cell (bounded by the box of its own points) only centers whose distance to the box
    can beat the best farthest-corner distance are candidates; the true nearest center always is one,
    and candidates keep ascending index order, so ties resolve as in a brute-force argmin. Points are
    stored cell by cell in blocks of _BLOCK (padded with far-away points), so a block and its cell's
    candidates form one small dense distance matrix."""

    def __init__(self, points: Tensor):
        h = 2 * _GRID_RADIUS / _GRID
        ij = ((points + _GRID_RADIUS) / h).floor().clamp_(0, _GRID - 1).long()
        cell = ij[:, 0] * _GRID + ij[:, 1]
        cells = _GRID * _GRID
        index = cell[:, None].expand(-1, 2)
        # amin/amax are exact, so their order does not matter; empty cells keep a zero-size box.
        zeros = torch.zeros(cells, 2, dtype=points.dtype)
        self.lo = zeros.scatter_reduce(0, index, points, "amin", include_self=False)
        self.hi = zeros.scatter_reduce(0, index, points, "amax", include_self=False)

        count = torch.bincount(cell, minlength=cells)
        blocks = (count + _BLOCK - 1) // _BLOCK
        block_start = torch.cumsum(blocks, 0) - blocks
        first_point = torch.cumsum(count, 0) - count
        order = torch.argsort(cell, stable=True)
        sorted_cell = cell[order]
        rank = torch.arange(len(points)) - first_point[sorted_cell]
        slot = torch.empty_like(order)
        slot[order] = block_start[sorted_cell] * _BLOCK + rank
        self.slot = slot  # where each point sits in the blocked layout
        self.block_cell = torch.repeat_interleave(torch.arange(cells), blocks)
        blocked = torch.full((int(blocks.sum()) * _BLOCK, 2), _FAR, dtype=points.dtype)
        blocked[slot] = points
        self.blocked = blocked.view(-1, _BLOCK, 2)

    def _candidates(self, centers: Tensor) -> Tensor:
        """int64 [cells, M]: candidate center indices per cell, ascending, padded with len(centers)."""
        c = centers[None]  # [1, K, 2]
        lo, hi = self.lo[:, None], self.hi[:, None]  # [cells, 1, 2]
        far = torch.maximum((c - lo).abs(), (hi - c).abs()).square().sum(-1)
        near = (torch.clamp(lo - c, min=0) + torch.clamp(c - hi, min=0)).square().sum(-1)
        mask = near <= far.min(dim=1, keepdim=True).values
        width = int(mask.sum(dim=1).max())
        position = torch.cumsum(mask, dim=1) - 1
        out = torch.full((len(mask), width + 1), len(centers), dtype=torch.int64)
        # Non-candidates all write to the spare last column, which is dropped.
        position = torch.where(mask, position, torch.full_like(position, width))
        out.scatter_(1, position, torch.arange(len(centers)).expand_as(position).contiguous())
        out[:, width] = len(centers)
        return out[:, :width]

    def assign(self, centers: Tensor, chunk: int = 2048) -> tuple[Tensor, Tensor]:
        """(nearest center index int64 [N], Euclidean distance fp64 [N])."""
        candidates = self._candidates(centers)
        padded = torch.cat([centers, torch.full((1, 2), _FAR, dtype=centers.dtype)])
        nblocks = len(self.blocked)
        index = torch.empty(nblocks, _BLOCK, dtype=torch.int64)
        dist = torch.empty(nblocks, _BLOCK, dtype=centers.dtype)
        for s in range(0, nblocks, chunk):
            cand = candidates[self.block_cell[s:s + chunk]]  # [b, M]
            xy = padded[cand]  # [b, M, 2]
            p = self.blocked[s:s + chunk]  # [b, BLOCK, 2]
            # Without the matmul shortcut cdist is the exact per-pair Euclidean distance.
            best, pos = torch.cdist(p, xy, compute_mode="donot_use_mm_for_euclid_dist").min(dim=2)
            index[s:s + chunk] = cand.gather(1, pos)
            dist[s:s + chunk] = best
        return index.view(-1)[self.slot], dist.view(-1)[self.slot]


def _ordered_sum(values: Tensor, index: Tensor, bins: int) -> Tensor:
    # bincount accumulates in one sequential pass: the same bits on any thread count.
    return torch.bincount(index, weights=values, minlength=bins)


def fit_table(table_bits: int, samples: int = SAMPLES, verbose: bool = False) -> Tensor:
    """fp32 [2**table_bits, 2]: the k-means table of the hybrid code, rescaled as QTIP does."""
    k = 1 << table_bits
    gen = torch.Generator().manual_seed(SEED_BASE + table_bits)
    centers = torch.randn(k, 2, generator=gen).double()
    points = torch.randn(samples, 2, generator=gen).double()
    assigner = _GridAssigner(points)
    previous = math.inf
    for iteration in range(MAX_ITERATIONS):
        index, dist = assigner.assign(centers)
        mean_dist = float(_ordered_sum(dist, index, k).sum()) / samples
        counts = torch.bincount(index, minlength=k).double()
        sums = torch.stack([_ordered_sum(points[:, d], index, k) for d in range(2)], dim=1)
        centers = torch.where(counts[:, None] > 0, sums / counts.clamp(min=1)[:, None], centers)
        if verbose:
            print(f"q{table_bits} iteration {iteration}: mean distance {mean_dist:.7f}")
        if previous - mean_dist <= STOP_DECREASE:
            break
        previous = mean_dist
    std = centers.std(unbiased=False)
    return (centers / std * TARGET_STD).float()


def generate(table_bits=TABLE_BITS, verbose: bool = False) -> dict[str, Tensor]:
    return {table_key(q): fit_table(q, verbose=verbose).contiguous() for q in table_bits}


def main() -> None:
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write " + FILE_NAME + " into")
    parser.add_argument("--table-bits", type=int, nargs="+", default=list(TABLE_BITS))
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    tables = {}
    for q in args.table_bits:
        start = time.perf_counter()
        tables.update(generate([q], verbose=args.verbose))
        print(f"q{q}: {time.perf_counter() - start:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    save_file(tables, os.path.join(args.out, FILE_NAME))


if __name__ == "__main__":
    main()
