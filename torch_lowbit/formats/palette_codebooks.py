"""Codebooks for a standard Gaussian source (Q-Palette's NUQ and VQ): how they are defined and loaded
(torch_lowbit/tools/gen_palette_tables.py makes them).

After incoherence processing (torch_lowbit/rotations) a weight row is close to i.i.d. N(0, σ²),
so one codebook per rate serves every layer:
- NUQ b-bit: the Lloyd-Max quantizer of N(0, 1) (2^b levels), computed exactly from the Gaussian
  density (no sampling): thresholds at midpoints, levels at the conditional means, iterated.
- VQ b bits/weight: 2^(2b) points in the plane from k-means (Lloyd) on 2-D Gaussian samples drawn
  with a fixed seed, k-means++ initialization, float64 throughout.

The tables ship in data/palette_tables.safetensors; `python -m torch_lowbit.tools.gen_palette_tables`
regenerates that file bit for bit (a test checks it), so the data is reproducible, not trusted.
"""
from __future__ import annotations

import functools
import os

from torch import Tensor

DATA_FILE = os.path.join(os.path.dirname(__file__), "data", "palette_tables.safetensors")
NUQ_BITS = (1, 2, 3, 4)
VQ_BITS = (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0)


def nuq_key(bits: int) -> str:
    return f"nuq{bits}"


def vq_key(bits: float) -> str:
    return f"vq{bits:g}"


def vq_entries(bits: float) -> int:
    return 2 ** round(2 * bits)


@functools.lru_cache(maxsize=None)
def _shipped() -> dict[str, Tensor]:
    from safetensors.torch import load_file
    if not os.path.exists(DATA_FILE):
        raise FileNotFoundError(f"{DATA_FILE} is missing: reinstall torch_lowbit or regenerate it with "
                                "`python -m torch_lowbit.tools.gen_palette_tables`")
    return load_file(DATA_FILE)


def nuq_levels(bits: int) -> Tensor:
    """fp32 [2^bits] Lloyd-Max levels of N(0, 1), ascending (shipped table)."""
    return _shipped()[nuq_key(bits)].clone()


def vq_codebook(bits: float) -> Tensor:
    """fp32 [2^(2 bits), 2] k-means codebook of the 2-D standard Gaussian (shipped table)."""
    return _shipped()[vq_key(bits)].clone()
