"""Dynamic int8 activations, the pure-torch twins of csrc/common/act_q8.cpp: ggml's Q8_0 math (per
token, per 32 consecutive features, d = max|x| / 127 and q = round_half_even(x * (1 / d))) and
QuaRot's per-token symmetric codes of `bits` bits (one d per token; defined in torch_lowbit/act_codes.py,
below the op and kernel layers that round with it, and re-exported here)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..act_codes import quantize_per_token, symmetric_min_code  # noqa: F401 (re-exported)

ACT_BLOCK = 32


def quantize_q8_blocks(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] (K % 32 == 0) -> (int8 codes [..., K], fp32 scales [..., K/32])."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // ACT_BLOCK, ACT_BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv)  # torch.round is half-to-even, as the kernels' rounding mode
    return q.to(torch.int8).reshape(x.shape), d.squeeze(-1)


def fake_quantize_q8_blocks(x: Tensor) -> Tensor:
    """The fp32 activations an int8 kernel effectively multiplies with (q * d)."""
    q, d = quantize_q8_blocks(x)
    qb = q.float().reshape(*x.shape[:-1], x.shape[-1] // ACT_BLOCK, ACT_BLOCK)
    return (qb * d.unsqueeze(-1)).reshape(x.shape)
