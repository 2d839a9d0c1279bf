"""Block LDLQ (QuIP# / Q-Palette) for the palette formats: GPTQ's error feedback with blocks of
columns coded jointly by the format's own encoder (NUQ 1 column, VQ 2, TCQ 16 = one tile).

In the rotated basis (W' = W S H, Hessian H' = (S H)ᵀ E[x xᵀ] (S H), since x' = x S H) and with U
the upper Cholesky factor of H'⁻¹, block b of columns is coded from its current (error-updated)
values, and the not-yet-coded columns absorb its error: W'_rest -= (W'_b - Q_b) U_bb⁻¹ U_b,rest.
Codes, row scales and signs are the format's usual tensors (same storage and dequantizer as RTN).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..formats.palette import PaletteFormat, HalfTCQ
from ..rotations import hadamard_transform
from .gptq import _inverse_hessian_cholesky


def rotated_hessian(fmt: PaletteFormat, hessian: Tensor) -> Tensor:
    """(S H)ᵀ E[x xᵀ] (S H): the Hessian of the rotated activations x' = x S H."""
    h = hessian.detach().float()
    if not fmt.rotate:
        return h
    s = fmt.signs(h.shape[0]).to(h.device)
    return hadamard_transform(hadamard_transform(h, s).T.contiguous(), s)


def _block_coder(fmt: PaletteFormat, k: int):
    """(block width, coder(column0) -> the format whose encode_unit codes columns from column0 on)."""
    if isinstance(fmt, HalfTCQ):
        lo, hi = fmt.halves()
        return 16, (lambda c0: lo if c0 < k // 2 else hi)
    width = {"nuq": 1, "vq": 2, "tcq": 16}[fmt.prefix]
    return width, (lambda c0: fmt)


@torch.no_grad()
def ldlq_quantize(fmt: PaletteFormat, weight: Tensor, hessian: Tensor, *, damp: float = 0.01,
                  lazy_columns: int = 128) -> dict[str, Tensor]:
    """fmt's tensors for `weight` [N, K] rounded with block LDLQ against `hessian` [K, K] (E[x xᵀ])."""
    if not isinstance(fmt, PaletteFormat):
        raise ValueError(f"LDLQ rounding is for the palette formats; {fmt.name} is not one")
    fmt.check_weight(weight)
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"LDLQ: hessian must be [{k}, {k}], got {tuple(hessian.shape)}")
    w0 = fmt.rotate_weight(weight)
    w = w0.clone()
    h = rotated_hessian(fmt, hessian).to(w.device)
    u = _inverse_hessian_cholesky(h, damp)
    rms = w0.pow(2).mean(1, keepdim=True).sqrt()
    rms = torch.where(rms > 0, rms, torch.ones_like(rms))
    width, coder = _block_coder(fmt, k)
    parts: dict[str, list[Tensor]] = {}
    lazy = max(lazy_columns // width, 1) * width
    for b0 in range(0, k, lazy):  # GPTQ's lazy batches: updates past the batch wait for one matmul
        b1 = min(b0 + lazy, k)
        scaled_err = torch.empty(n, b1 - b0, device=w.device)
        for c0 in range(b0, b1, width):
            c1 = c0 + width
            f = coder(c0)
            codes = f.encode_unit(w[:, c0:c1] / rms)
            err = w[:, c0:c1] - f.decode_unit(codes) * f.unit_scale() * rms
            e = torch.linalg.solve_triangular(u[c0:c1, c0:c1], err, upper=True, left=False)
            scaled_err[:, c0 - b0:c1 - b0] = e
            w[:, c1:b1] -= e @ u[c0:c1, c1:b1]
            key_suffix = ("_lo" if c0 < k // 2 else "_hi") if isinstance(fmt, HalfTCQ) else ""
            for name, t in codes.items():
                parts.setdefault(name + key_suffix, []).append(t)
        w[:, b1:] -= scaled_err @ u[b0:b1, b1:]
    q = {name: torch.cat(ts, dim=1) for name, ts in parts.items()}
    return fmt.finish(w0, q)
