"""Block LDLQ (QuIP# / Q-Palette) for the palette and general VQ formats: GPTQ's error feedback with
blocks of columns coded jointly by the format's own encoder (NUQ 1 column, VQ 2, TCQ 16 = one tile,
gvq one vector: codebooks fixed first, GPTVQ's order).

In the rotated basis (W' = W S H, Hessian H' = (S H)ᵀ E[x xᵀ] (S H), since x' = x S H) and with U
the upper Cholesky factor of H'⁻¹, block b of columns is coded from its current (error-updated)
values, and the not-yet-coded columns absorb its error: W'_rest -= (W'_b - Q_b) U_bb⁻¹ U_b,rest.
Codes, row scales and signs are the format's usual tensors (same storage and dequantizer as RTN).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..formats.base import Format
from ..formats.gvq import GeneralVQ
from ..formats.palette import PaletteFormat, HalfTCQ
from ..rotations import hadamard_transform
from .gptq import _inverse_hessian_cholesky


def rotated_hessian(fmt: "PaletteFormat | GeneralVQ", hessian: Tensor) -> Tensor:
    """(S H)ᵀ E[x xᵀ] (S H): the Hessian of the rotated activations x' = x S H."""
    h = hessian.detach().float()
    if not fmt.rotate:
        return h
    s = fmt.signs(h.shape[0]).to(h.device)
    return hadamard_transform(hadamard_transform(h, s).T.contiguous(), s)


def _palette_coder(fmt: PaletteFormat, weight: Tensor):
    """A palette format's (W', width, encode, finish) for the LDLQ loop: codes from each block's values
    divided by the row RMS, coded by the format's own encoder (half-TCQ: each half's)."""
    w0 = fmt.rotate_weight(weight)
    k = w0.shape[1]
    rms = w0.pow(2).mean(1, keepdim=True).sqrt()
    rms = torch.where(rms > 0, rms, torch.ones_like(rms))
    if isinstance(fmt, HalfTCQ):
        lo, hi = fmt.halves()
        width, coder = 16, (lambda c0: lo if c0 < k // 2 else hi)
    else:
        width, coder = {"nuq": 1, "vq": 2, "tcq": 16}[fmt.prefix], (lambda c0: fmt)

    def encode(c0: int, cols: Tensor):
        f = coder(c0)
        codes = f.encode_unit(cols / rms)
        suffix = ("_lo" if c0 < k // 2 else "_hi") if isinstance(fmt, HalfTCQ) else ""
        return {name + suffix: t for name, t in codes.items()}, f.decode_unit(codes) * f.unit_scale() * rms

    def finish(w: Tensor, parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        names = dict.fromkeys(name for p in parts for name in p)
        return fmt.finish(w, {name: torch.cat([p[name] for p in parts if name in p], dim=1) for name in names})

    return w0, width, encode, finish


@torch.no_grad()
def ldlq_quantize(fmt: Format, weight: Tensor, hessian: Tensor, *, damp: float = 0.01,
                  lazy_columns: int = 128) -> dict[str, Tensor]:
    """fmt's tensors for `weight` [N, K] rounded with block LDLQ against `hessian` [K, K] (E[x xᵀ]):
    the palette formats (their own encoders) and the general VQ formats (fmt.ldlq_coder: codebooks
    fixed first, then vector by vector)."""
    if not isinstance(fmt, (PaletteFormat, GeneralVQ)):
        raise ValueError(f"LDLQ rounding is for the palette and gvq formats; {fmt.name} is neither")
    fmt.check_weight(weight)
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"LDLQ: hessian must be [{k}, {k}], got {tuple(hessian.shape)}")
    h = rotated_hessian(fmt, hessian).to(weight.device)
    if isinstance(fmt, GeneralVQ):
        w0, width, encode, finish = fmt.ldlq_coder(weight, h)
    else:
        w0, width, encode, finish = _palette_coder(fmt, weight)
    w = w0.clone()
    u = _inverse_hessian_cholesky(h, damp)
    parts = []
    lazy = max(lazy_columns // width, 1) * width
    for b0 in range(0, k, lazy):  # GPTQ's lazy batches: updates past the batch wait for one matmul
        b1 = min(b0 + lazy, k)
        scaled_err = torch.empty(n, b1 - b0, device=w.device)
        for c0 in range(b0, b1, width):
            c1 = c0 + width
            codes, values = encode(c0, w[:, c0:c1])
            e = torch.linalg.solve_triangular(u[c0:c1, c0:c1], w[:, c0:c1] - values, upper=True, left=False)
            scaled_err[:, c0 - b0:c1 - b0] = e
            w[:, c1:b1] -= e @ u[c0:c1, c1:b1]
            parts.append(codes)
        w[:, b1:] -= scaled_err @ u[b0:b1, b1:]
    return finish(w0, parts)
