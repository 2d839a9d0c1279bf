"""Regenerates the NUQ/VQ Gaussian codebooks (formats/palette_codebooks.py says what they are),
bit for bit: `python -m torch_lowbit.tools.gen_palette_tables [--out FILE]`."""
from __future__ import annotations

import argparse
import math
import os

import torch
from torch import Tensor

from ..formats.palette_codebooks import DATA_FILE, NUQ_BITS, VQ_BITS, nuq_key, vq_entries, vq_key

_VQ_SEED = 20241101


def lloyd_max_gaussian(bits: int, iters: int = 2000) -> Tensor:
    """float64 [2^bits]: the MSE-optimal scalar quantizer levels for N(0, 1), ascending."""
    n = 2 ** bits
    levels = torch.special.ndtri((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    pdf = lambda t: torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)  # noqa: E731
    for _ in range(iters):
        inner = (levels[1:] + levels[:-1]) / 2
        lo = torch.cat([torch.tensor([-math.inf], dtype=torch.float64), inner])
        hi = torch.cat([inner, torch.tensor([math.inf], dtype=torch.float64)])
        mass = torch.special.ndtr(hi) - torch.special.ndtr(lo)
        new = (pdf(lo) - pdf(hi)) / mass  # E[X | lo < X < hi]
        if torch.equal(new, levels):
            break
        levels = new
    return levels


def _nearest(x: Tensor, centers: Tensor) -> Tensor:
    """Index of the nearest center for each row of x (squared Euclidean distance)."""
    c2 = (centers * centers).sum(1)
    chunk = max(1024, (1 << 22) // centers.shape[0])  # distance blocks of ~32 MB
    out = torch.empty(x.shape[0], dtype=torch.long)
    for s in range(0, x.shape[0], chunk):
        xs = x[s:s + chunk]
        out[s:s + chunk] = (c2 - 2 * xs @ centers.T).argmin(1)
    return out


def kmeans_gaussian_2d(entries: int, samples: int, iters: int, seed: int) -> Tensor:
    """float64 [entries, 2]: Lloyd's k-means on `samples` 2-D N(0, I) points (k-means++ start)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 2, dtype=torch.float64, generator=gen)
    centers = x[torch.randint(samples, (1,), generator=gen)]
    d2 = ((x - centers[0]) ** 2).sum(1)
    for _ in range(1, entries):  # k-means++: next center drawn with probability ∝ distance²
        pick = torch.multinomial(d2 / d2.sum(), 1, generator=gen)
        centers = torch.cat([centers, x[pick]])
        d2 = torch.minimum(d2, ((x - x[pick]) ** 2).sum(1))
    prev = None
    for _ in range(iters):
        idx = _nearest(x, centers)
        if prev is not None and torch.equal(idx, prev):
            break  # assignments stable: converged
        prev = idx
        count = torch.bincount(idx, minlength=entries).to(torch.float64)
        sums = torch.stack([torch.bincount(idx, weights=x[:, j], minlength=entries) for j in range(2)], 1)
        centers = torch.where(count[:, None] > 0, sums / count.clamp_min(1)[:, None], centers)
    order = torch.argsort(centers[:, 0] * 1e6 + centers[:, 1])  # a canonical order, not k-means' own
    return centers[order]


def generate_tables(vq_bits=VQ_BITS) -> dict[str, Tensor]:
    """All palette tables (fp32), deterministic. k-means cost grows with the entries: vq5 takes minutes."""
    tables = {nuq_key(b): lloyd_max_gaussian(b).float() for b in NUQ_BITS}
    for b in vq_bits:
        n = vq_entries(b)
        tables[vq_key(b)] = kmeans_gaussian_2d(n, samples=max(1 << 17, 512 * n), iters=300 if n <= 64 else 120,
                                               seed=_VQ_SEED + n).float()
    return tables


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Regenerate the NUQ/VQ Gaussian codebooks (deterministic).")
    p.add_argument("--out", default=DATA_FILE)
    args = p.parse_args(argv)
    from safetensors.torch import save_file
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tables = generate_tables()
    save_file({k: v.contiguous() for k, v in tables.items()}, args.out)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1 << 20, 2, generator=gen)
    for k, t in tables.items():
        if t.dim() == 1:
            err = ((x[:, 0:1] - t[None]) ** 2).min(1).values.mean()
        else:
            err = ((x - t[_nearest(x.double(), t.double())]) ** 2).mean()
        print(f"{k:6s} entries {t.shape[0]:5d}  MSE on N(0,1): {float(err):.5f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
