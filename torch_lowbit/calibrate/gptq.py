"""GPTQ (Frantar et al., 2022) rounding for scalar-codebook group formats (and gcb and the K-quants, whose
parameters it fixes up front): quantize one input column
at a time and spread its error over the not-yet-quantized columns through the inverse Hessian of
the layer's calibration inputs. Codes come from the format's own encode(); group parameters from its
fit_groups(), either on the original weights up front (static groups, required with act_order) or
on the error-updated weights when a group starts. The result is the same tensors as fmt.quantize()
(same storage, same dequantizer), only better-rounded.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..formats.scalar import ScalarCodebookFormat


def _inverse_hessian_cholesky(h: Tensor, damp: float) -> Tensor:
    h = h.clone()
    diag = torch.arange(h.shape[0], device=h.device)
    h[diag, diag] += damp * torch.mean(torch.diag(h)).clamp_min(1e-8)
    for _ in range(6):  # add damping until positive definite (tiny or rank-deficient calibration)
        chol, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)
        h[diag, diag] += 10 * damp * torch.mean(torch.diag(h)).clamp_min(1e-8)
    raise RuntimeError("GPTQ: the calibration Hessian is not positive definite even after damping")


def _fit16(fmt: ScalarCodebookFormat, groups: Tensor, importance=None):
    """fp16-rounded (as fp32) group params for groups [N, G, g] -> ([N, G], [N, G] or None)."""
    s, m = fmt.fit_groups(groups, importance)
    s = s.squeeze(-1).half().float()
    return s, (m.squeeze(-1).half().float() if m is not None else None)


@torch.no_grad()
def gptq_quantize(fmt: ScalarCodebookFormat, weight: Tensor, hessian: Tensor, *, block: int = 128,
                  damp: float = 0.01, act_order: bool = True) -> dict[str, Tensor]:
    """fmt's tensors for `weight` [N, K] rounded with GPTQ against `hessian` [K, K] (= E[x xᵀ]).

    act_order quantizes columns by decreasing Hessian diagonal (most-excited inputs first), with
    group parameters fixed up front from the original weights."""
    from ..formats.gcb import GroupCodebook
    from ..formats.kquants import KQuantFormat
    if not isinstance(fmt, (ScalarCodebookFormat, GroupCodebook, KQuantFormat)):
        raise ValueError(f"GPTQ rounding supports scalar-codebook, gcb and K-quant formats; {fmt.name} is none of them")
    fmt.check_weight(weight)
    n, k = weight.shape
    fmt = fmt.for_layer(k)
    g = fmt.group_size
    if hessian.shape != (k, k):
        raise ValueError(f"GPTQ: hessian must be [{k}, {k}], got {tuple(hessian.shape)}")
    w = weight.detach().float().clone()
    h = hessian.detach().float().to(w.device).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    if isinstance(fmt, (GroupCodebook, KQuantFormat)):  # parameters fixed up front (gcb: each sub-group's codebook
        # and scale; K-quants: the imatrix quantizer's d, dmin, sub-scales and mins of the original weight)
        fixed = fmt.fixed_parameters(w, torch.diag(h))
        return _gptq_columns(w, h, _order(h, act_order), damp, block, 1,
                             encode=lambda col, x: fmt.encode_column(fixed, col, x),
                             finish=lambda codes: dict(fixed, codes=codes))
    table = fmt.code_values().to(w.device)

    static = act_order or g == k  # one group per row (int4_pc): its scale is fit up front either way
    if static:
        scales, mins = _fit16(fmt, w.reshape(n, k // g, g), fmt._importance_groups(torch.diag(h), k))
    else:
        scales = torch.empty(n, k // g, device=w.device)
        mins = torch.empty(n, k // g, device=w.device) if fmt.has_mins else None

    def begin_group(col, cols):  # without act_order: fit each group on the error-updated weights
        s, m = _fit16(fmt, cols.unsqueeze(1))
        scales[:, col // g] = s[:, 0]
        if mins is not None:
            mins[:, col // g] = m[:, 0]

    def encode(col, x):
        s = scales[:, col // g]
        m = mins[:, col // g] if mins is not None else None
        c = fmt.encode(x, s, m)
        return c, table[c.long()] * s + (m if m is not None else 0.0)

    def finish(codes):
        out = {"codes": codes, "scales": scales.half()}
        if mins is not None:
            out["mins"] = mins.half()
        return out

    # static groups: any block size (blocks of whole groups only matter when groups begin mid-sweep)
    return _gptq_columns(w, h, _order(h, act_order), damp, block, 1 if static else g, encode, finish,
                         begin_group=None if static else begin_group)


def _order(h: Tensor, act_order: bool) -> Tensor:
    """Column order: decreasing Hessian diagonal (most-excited inputs first) with act_order."""
    return torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(h.shape[0], device=h.device)


def _gptq_columns(w: Tensor, h: Tensor, perm: Tensor, damp: float, block: int, group: int, encode, finish,
                  begin_group=None):
    """The GPTQ sweep over columns in `perm` order: encode(col, values [N]) -> (codes, dequantized values),
    the scaled error fed forward to the columns not yet coded (lazily, one matmul per block of whole
    groups); finish(codes [N, K] uint8) -> the format's tensors."""
    n, k = w.shape
    w, h = w[:, perm], h[perm][:, perm]
    hinv = _inverse_hessian_cholesky(h, damp)
    block = max(block // group, 1) * group  # whole groups per block (matters without act_order)
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = w[:, b0:b1].clone()
        err = torch.zeros_like(wb)
        hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = int(perm[b0 + i])  # original column index
            if begin_group is not None and col % group == 0:
                begin_group(col, wb[:, i:i + group])
            c, q = encode(col, wb[:, i])
            codes[:, col] = c
            e = (wb[:, i] - q) / hb[i, i]
            wb[:, i:] -= e.unsqueeze(1) * hb[i, i:].unsqueeze(0)
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    return finish(codes)
