"""Group-wise asymmetric integer KV-cache entries (QuaRot's / KIVI's per-head key and value groups).

Each token's key (or value) vector of one head, x [..., D], is cut into groups of `group` channels
(group divides D); per group d = (max - min) / (2^bits - 1) and m = min, both stored as fp16, and
q = clamp(round((x - m) / d), 0, 2^bits - 1) computed with those fp16-rounded d and m so that
dequantization q * d + m is exactly what the kernels reconstruct. 4-bit codes are packed two per byte
(channel 2i in the low nibble, 2i+1 in the high one); 8-bit codes are one byte each.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..ops.attention import register_kv_reference_cpu_impl
from .uniform import minmax_params, nearest_affine_codes

KV_BITS = (4, 8)


def check_kv_config(bits: int, group: int, head_dim: int) -> None:
    if bits not in KV_BITS:
        raise ValueError(f"KV cache: bits must be 4 or 8, got {bits!r}")
    if group <= 0 or head_dim % group or group % 2:
        raise ValueError(f"KV cache: the group ({group}) must be an even divisor of the head dimension "
                         f"({head_dim}); use group={head_dim} or a divisor of it such as {head_dim // 2}")


def quantize_kv(x: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """x [..., D] -> (codes uint8 [..., D * bits / 8], scale fp16 [..., D / group], min fp16 [..., D / group])."""
    check_kv_config(bits, group, x.shape[-1])
    xg = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale, mn = (p.to(torch.float16) for p in minmax_params(xg, bits))  # the weights' int_asym minmax rule
    q = nearest_affine_codes(xg, scale.float(), mn.float(), 2 ** bits - 1).reshape(x.shape)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, scale.squeeze(-1), mn.squeeze(-1)


def dequantize_kv(codes: Tensor, scale: Tensor, mn: Tensor, bits: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The inverse of quantize_kv: [..., D] in `dtype` (q * d + m in fp32, then cast)."""
    if bits == 4:
        q = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    else:
        q = codes
    groups = scale.shape[-1]
    qg = q.float().reshape(*q.shape[:-1], groups, q.shape[-1] // groups)
    x = qg * scale.float().unsqueeze(-1) + mn.float().unsqueeze(-1)
    return x.reshape(q.shape).to(dtype)


register_kv_reference_cpu_impl(dequantize_kv)


def kv_bytes_per_token_head(head_dim: int, bits: int, group: int) -> float:
    """Storage per token and head: codes plus the fp16 scale and min of each group."""
    return head_dim * bits / 8 + 4 * head_dim / group
