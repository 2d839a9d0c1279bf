"""Dynamic int8 activations, the pure-torch twins of csrc/common/act_q8.cpp: ggml's Q8_0 math (per
token, per 32 consecutive features, d = max|x| / 127 and q = round_half_even(x * (1 / d))) and
QuaRot's per-token symmetric codes of `bits` bits (one d per token)."""
from __future__ import annotations

import torch
from torch import Tensor

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


def symmetric_min_code(bits: int) -> int:
    """The lowest symmetric code: -2^(b-1) (QuaRot's grid), except -127 at 8 bits, the restricted int8
    range, because the int8 kernels negate activations with vpsignb, which cannot negate -128."""
    return -127 if bits == 8 else -(2 ** (bits - 1))


def quantize_per_token(x: Tensor, bits: int, clip_ratio: float = 1.0) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (codes int8 [..., K], fp32 d [..., 1]): d = max|x| * (clip / (2^(bits-1) - 1)) per
    token (1 where x is all zero), codes clamp(round_half_even(x / d)). The kernels' twin (CPU:
    quantize_acts_per_token; Triton: the integer-activation linear)."""
    xf = x.float()
    qmax = 2 ** (bits - 1) - 1
    d = xf.abs().amax(-1, keepdim=True) * (clip_ratio / qmax)
    d = torch.where(d > 0, d, torch.ones_like(d))
    return torch.clamp(torch.round(xf / d), symmetric_min_code(bits), qmax).to(torch.int8), d
