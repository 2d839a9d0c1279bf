"""A format's distortion: the relative squared error ‖W − Q(W)‖² / ‖W‖² of its quantize→dequantize.

Measured on a given weight (`relative_error`), or on a standard Gaussian (`gaussian_distortion`):
what a rotated (incoherence-processed) Q-Palette format gives any layer, since the rotation makes a
weight's entries close to Gaussian; the linearity theorem's loss model (torch_lowbit/nn/msq.py) uses
it without quantizing the layers. Gaussian values are cached in <cache>/gaussian_distortion.json per
(torch_lowbit version, format, shape, seed): TCQ takes ~2 s per million weights to quantize."""
from __future__ import annotations

import threading
from typing import Optional

import torch
from torch import Tensor

from ..core.cache import read_json, write_json
from ..version import __version__
from .base import Format

CACHE_FILE = "gaussian_distortion.json"
GAUSSIAN_SHAPE = (256, 4096)  # a relative standard error of ~0.3% on the mean squared error
_memo: dict[str, float] = {}
_lock = threading.Lock()


@torch.no_grad()
def squared_error(fmt: Format, weight: Tensor, importance: Optional[Tensor] = None) -> Tensor:
    """(W − Q(W))² per weight (fp32) of fmt's data-free quantize→dequantize of weight [N, K], rounding
    weighted by importance [K] where given."""
    w = weight.detach().float()
    imp = None if importance is None else importance.detach().float().to(w.device)
    return (fmt.dequantize(fmt.quantize(w, imp)).to(w.device) - w).pow(2)


def relative_error(fmt: Format, weight: Tensor, importance: Optional[Tensor] = None) -> float:
    """‖W − Q(W)‖² / ‖W‖² of fmt's data-free quantize→dequantize of weight [N, K] (rounding weighted
    by importance [K] where given)."""
    norm = float(weight.detach().float().pow(2).sum())
    if not norm > 0:
        raise ValueError("relative_error: the weight is all zeros (no relative error is defined)")
    return float(squared_error(fmt, weight, importance).sum()) / norm


def gaussian_distortion(fmt: Format, shape: tuple[int, int] = GAUSSIAN_SHAPE, seed: int = 0) -> float:
    """fmt's relative error on a standard Gaussian matrix of `shape` (seeded), cached (module doc)."""
    key = f"{__version__}|{fmt.name}|{shape[0]}x{shape[1]}|{seed}"
    with _lock:
        if key in _memo:
            return _memo[key]
        table = _read()
        if key not in table:
            problem = fmt.shape_problem(*shape)
            if problem is not None:
                raise ValueError(f"gaussian_distortion: {fmt.name} cannot hold a {shape[0]}x{shape[1]} matrix: {problem}")
            w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
            value = relative_error(fmt, w)
            table = _read()  # another process may have added entries meanwhile
            table[key] = value
            write_json(CACHE_FILE, table)
        _memo[key] = float(table[key])
        return _memo[key]


def _read() -> dict[str, float]:
    return {k: float(v) for k, v in read_json(CACHE_FILE).items() if isinstance(v, (int, float))}
