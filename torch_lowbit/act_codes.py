"""QuaRot's per-token symmetric activation codes: the one definition, at the bottom layer because the
op's CPU reference (ops/library.py) and the Triton integer-activation kernel (triton_kernels/int_act.py)
round with it too; formats/activations.py re-exports it beside ggml's Q8_0 blocks."""
from __future__ import annotations

import torch
from torch import Tensor

ACT_BITS = (2, 3, 4, 8)  # the per-token activation widths the kernels and wrappers take
# The one block of block-scaled activations the int8-weight CPU kernels round in-kernel (their per-32
# activation blocks, csrc kActBlock); other blocks are rounded in torch.
KERNEL_ACT_BLOCK = 32


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
