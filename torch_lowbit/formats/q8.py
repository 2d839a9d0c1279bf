"""q8_0: ggml's Q8_0, the 8-bit block format llama.cpp keeps token embeddings and output heads in.

Blocks of 32 consecutive input features, one fp16 scale d per block, int8 q in [-127, 127],
value = q * d. As a scalar-codebook format (one reference dequantizer for the family): the code is
the byte q + 128 (uint8) and the 256-entry table is code - 128, so codes/scales are exactly a GGUF
Q8_0 block's qs (as uint8 after adding 128) and d.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import torch
from torch import Tensor

from .registry import register_format
from .scalar import FixedBlockFormat

Q8_OFFSET = 128  # code = q + 128: int8 q as an unsigned byte (the int8 kernels' u8 x s8 products)


def round_half_away(v: Tensor) -> Tensor:
    """C's roundf (ties away from zero), exact in fp32: torch.round rounds ties to even, and
    floor(|v| + 0.5) is wrong just below .5, where |v| + 0.5 itself rounds up."""
    t = torch.trunc(v)
    tie = (v - t).abs() == 0.5  # v - trunc(v) is exact for |v| < 2^23
    return torch.where(tie, t + torch.sign(v), torch.round(v))


@dataclasses.dataclass(frozen=True)
class Q8_0(FixedBlockFormat):
    """ggml Q8_0, quantized step for step as ggml's quantize_row_q8_0_ref: d = amax / 127,
    id = 1 / d (0 when d = 0), q = roundf(x * id) in fp32 with the unrounded d, fp16(d) stored.
    Dequantized values equal gguf's reference dequantizer bit for bit.

    importance (imatrix; llama.cpp ignores it for Q8_0): each block's d is refit by weighted least
    squares on its codes (d = sum w q x / sum w q^2, re-encoded, twice), a block keeping the refit
    only where it lowers the block's weighted error with the stored fp16 d; never worse than rtn.
    The codes are then encoded against the fp16 d (still any int8 q, so still a valid Q8_0 block)."""

    kind: ClassVar[str] = "q8_0"
    encodes_with_unrounded_scale: ClassVar[bool] = True
    code_bits: ClassVar[int] = 8

    def code_values(self) -> Tensor:
        return torch.arange(256, dtype=torch.float32) - Q8_OFFSET

    def fit_groups(self, x: Tensor, importance: Optional[Tensor] = None) -> tuple[Tensor, None]:
        d = x.abs().amax(dim=-1, keepdim=True) / 127.0
        if importance is None:
            return d, None
        w = importance.expand_as(x)

        def stored_err(scale):  # weighted error of the codes encoded against the fp16 scale
            s16 = scale.half().float()
            q = self.encode(x, s16).float() - Q8_OFFSET
            return (w * (q * s16 - x) ** 2).sum(-1, keepdim=True), q

        err, q = stored_err(d)
        for _ in range(2):
            wqq = (w * q * q).sum(-1, keepdim=True)
            refit = torch.where(wqq > 0, (w * q * x).sum(-1, keepdim=True) / wqq.clamp_min(1e-30), d)
            new_err, new_q = stored_err(refit)
            better = new_err < err
            d, err, q = torch.where(better, refit, d), torch.where(better, new_err, err), torch.where(better, new_q, q)
        return d, None

    def encode(self, x: Tensor, scale: Tensor, mn: None = None) -> Tensor:
        inv_d = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
        q = round_half_away(x * inv_d).clamp_(-128, 127)  # ggml's own d never leaves [-127, 127]; GPTQ's may
        return (q + Q8_OFFSET).to(torch.uint8)


register_format(Q8_0())
