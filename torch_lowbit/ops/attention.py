"""The attention ops: gqa_attention (grouped-query attention of compiled generation over a float
cache; CPU only: csrc/attention.cpp), kv_attention (the same over a group-wise quantized KV cache,
codes dequantized in registers; CPU: csrc/kv_attention.cpp, CUDA: triton_kernels/kv_attention.py) and
kv_vq_attention (over a vector-quantized CQ cache, read through query tables and a value histogram;
CPU: csrc/kv_vq_attention.cpp).
Typed wrappers, fakes, the CUDA binding, the attention reference the kernels are tested against, and
the CPU references that stand in for the C++ kernels where the extension is absent."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ._common import Backend, check, register_reference_cpu_impl, register_triton_cuda, route


def gqa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, *,
                  backend: Backend = "auto") -> Tensor:
    """softmax(q kᵀ · scale + mask) v: q [B, H, S, D], k and v [B, Hkv, L, D] (H a multiple of Hkv);
    [B, S, H, D] out."""
    return route("gqa_attention", None, backend, q, k, v, mask, scale)


def kv_attention(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_min: Tensor, v_codes: Tensor, v_scale: Tensor,
                 v_min: Tensor, mask: Optional[Tensor], scale: float, bits: int, k_recent: Optional[Tensor] = None,
                 v_recent: Optional[Tensor] = None, recent_end: Optional[Tensor] = None, *,
                 backend: Backend = "auto") -> Tensor:
    """gqa_attention with k and v read from bits-bit codes [B, Hkv, L, D bits / 8] and their fp16 group
    scales and mins; the most recent tokens exact from the rings k_recent / v_recent (ending at
    recent_end) when given. [B, S, H, D] out in q's dtype."""
    return route("kv_attention", "kv_attention", backend, q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, mask,
                 scale, bits, k_recent, v_recent, recent_end)


def kv_vq_attention(q: Tensor, k_codes: Tensor, k_planes: Tensor, v_codes: Tensor, v_planes: Tensor,
                    mask: Optional[Tensor], scale: float, *, backend: Backend = "auto") -> Tensor:
    """gqa_attention with k and v read from CQ codes uint8 [B, Hkv, L, groups] (one byte per group of
    vec channels) and fp16 codebook planes [Hkv, groups, vec, entries]. [B, S, H, D] out in q's dtype."""
    return route("kv_vq_attention", None, backend, q, k_codes, k_planes, v_codes, v_planes, mask, scale)


def attention_reference(q: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], scale: float,
                        dtype: torch.dtype = torch.float32) -> Tensor:
    """softmax(q kᵀ scale + mask) v computed in `dtype`, K/V heads repeated for grouped-query attention:
    q [B, H, S, D], keys and values [B, Hkv, L, D], mask bool (True: attend) or additive, broadcastable to
    [B, H, S, L]; [B, S, H, D] out in `dtype` (a row that sees no key: NaN, as softmax of all -inf)."""
    g = q.shape[1] // keys.shape[1]
    k = keys.to(dtype).repeat_interleave(g, 1)
    v = values.to(dtype).repeat_interleave(g, 1)
    s = q.to(dtype) @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s + (torch.where(mask, 0.0, float("-inf")).to(dtype) if mask.dtype == torch.bool else mask.to(dtype))
    return (s.softmax(-1) @ v).transpose(1, 2)


def overlay_recent(x: Tensor, ring: Tensor, end: Tensor) -> Tensor:
    """A dequantized cache x [B, Hkv, L, D] with its most recent positions (end - r .. end - 1, r the ring's
    length) taken exact from the ring [B, Hkv, r, D], position p at ring slot p % r (kv_cache.py's ring)."""
    r = ring.shape[2]
    positions = torch.arange(x.shape[2], device=x.device)
    recent = (positions >= end - r) & (positions < end)
    return torch.where(recent[:, None], ring[:, :, positions % r].to(x.dtype), x)


def _attention_out(op, q, k):
    """The fake output [B, S, H, D] of q [B, H, S, D], after the grouped-heads check."""
    check(k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
          f"{op}: query heads {q.shape[1]} are not a multiple of KV heads {k.shape[1]}")
    b, h, s, d = q.shape
    return q.new_empty((b, s, h, d))


@torch.library.register_fake("torch_lowbit::gqa_attention")
def _gqa_attention_fake(q, k, v, mask, scale):
    check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "gqa_attention: q, k, v must be 4-D")
    return _attention_out("gqa_attention", q, k)


@torch.library.register_fake("torch_lowbit::kv_attention")
def _kv_attention_fake(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, mask, scale, bits, k_recent=None,
                       v_recent=None, recent_end=None):
    check(q.dim() == 4 and k_codes.dim() == 4, "kv_attention: q and k_codes must be 4-D")
    return _attention_out("kv_attention", q, k_codes)


@torch.library.register_fake("torch_lowbit::kv_vq_attention")
def _kv_vq_attention_fake(q, k_codes, k_planes, v_codes, v_planes, mask, scale):
    check(q.dim() == 4 and k_codes.dim() == 4 and k_planes.dim() == 4,
          "kv_vq_attention: q, k_codes and k_planes must be 4-D")
    check(k_planes.shape[1] * k_planes.shape[2] == q.shape[3] and k_codes.shape[3] == k_planes.shape[1],
          "kv_vq_attention: codebook planes [Hkv, groups, vec, entries] must cover the head dimension, one code "
          "per group")
    return _attention_out("kv_vq_attention", q, k_codes)


def _gqa_attention_reference(q, k, v, mask, scale):
    _gqa_attention_fake(q, k, v, mask, scale)
    return attention_reference(q, k, v, mask, scale).to(q.dtype).contiguous()


def register_kv_reference_cpu_impl(dequantize: Callable) -> None:
    """Where the extension is absent, kv_attention's CPU reference: the cache decoded by dequantize(codes,
    scale, min, bits) -> fp32 [..., D] (formats/kv.py's dequantize_kv), its recent ring laid over it, and
    attention_reference."""
    def reference(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, mask, scale, bits, k_recent=None,
                  v_recent=None, recent_end=None):
        _kv_attention_fake(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, mask, scale, bits)
        keys, values = dequantize(k_codes, k_scale, k_min, bits), dequantize(v_codes, v_scale, v_min, bits)
        if k_recent is not None:
            keys, values = overlay_recent(keys, k_recent, recent_end), overlay_recent(values, v_recent, recent_end)
        return attention_reference(q, keys, values, mask, scale).to(q.dtype).contiguous()

    register_reference_cpu_impl("kv_attention", reference)


def register_kv_vq_reference_cpu_impl(dequantize: Callable) -> None:
    """Where the extension is absent, kv_vq_attention's CPU reference: the cache decoded by
    dequantize(codes, planes) -> fp32 [..., D] (formats/kv_vq.py) and attention_reference."""
    def reference(q, k_codes, k_planes, v_codes, v_planes, mask, scale):
        _kv_vq_attention_fake(q, k_codes, k_planes, v_codes, v_planes, mask, scale)
        keys, values = dequantize(k_codes, k_planes), dequantize(v_codes, v_planes)
        return attention_reference(q, keys, values, mask, scale).to(q.dtype).contiguous()

    register_reference_cpu_impl("kv_vq_attention", reference)


register_reference_cpu_impl("gqa_attention", _gqa_attention_reference)
register_triton_cuda("kv_attention", "kv_attention")
