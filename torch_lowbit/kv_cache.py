"""A 4-bit (or 8-bit) KV cache for transformers models: static shapes, torch.compile-able.

    cache = QuantizedKVCache(model.config, max_cache_len=1024, bits=4, group=64, residual_length=128)
    model(ids, past_key_values=cache, use_cache=True)     # or CompiledGenerator(model, kv_bits=4)

Every cached token's key and value of each head is stored group-wise asymmetric (formats/kv.py:
codes, fp16 scale and min per group of head channels). As in QuaRot, keys are rotated by a Hadamard
matrix of the head dimension before rounding (rotate_keys): RoPE'd keys have a few large channels
and the rotation spreads them, so a 4-bit group loses much less. Attention needs q·kᵀ = (qH)(kH)ᵀ;
the cache returns dequant(kH)·Hᵀ, which gives the same scores as rotating the query, so the model's
attention code is untouched. The last `residual_length` tokens are also kept in full precision
(KIVI / QuaRot keep recent tokens exact) and returned in place of their rounded copies.

update() dequantizes the whole cache for the model's attention (the reference: saves memory, not
time). QuantizedKVLayer.attention() runs the kv_attention kernel, which reads the codes directly
(csrc/kv_attention.cpp), the exact recent ring included; CompiledGenerator uses it for its decode
steps.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from transformers.cache_utils import Cache, StaticLayer, get_layer_types_and_kwargs

from .formats.kv import check_kv_config, dequantize_kv, kv_bytes_per_token_head, quantize_kv
from .ops.attention import overlay_recent
from .rotations.ops import hadamard_transform


class QuantizedKVLayer(StaticLayer):
    """One attention layer's cache: codes and group scales for max_cache_len positions, plus a ring
    of the last residual_length tokens in the model's dtype."""

    def __init__(self, max_cache_len: int, bits: int = 4, group: int = 64, residual_length: int = 128,
                 rotate_keys: bool = True, **kwargs):
        super().__init__(max_cache_len=max_cache_len)
        if residual_length < 0:
            raise ValueError(f"KV cache: residual_length must be >= 0, got {residual_length}")
        self.bits, self.group, self.rotate_keys = int(bits), int(group), bool(rotate_keys)
        self.residual_length = min(int(residual_length), max_cache_len)
        # set by CompiledGenerator while it runs with its decode attention bound to this layer: update()
        # then returns just the new rows, and the attention reads the rounded cache itself
        self.defer_read = False

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        for d in (self.k_head_dim, self.v_head_dim):
            check_kv_config(self.bits, self.group, d)
        if self.rotate_keys:
            from .rotations.hadamard import check_hadamard_size
            check_hadamard_size(self.k_head_dim)
        b, h, n, r = self.batch_size, self.num_heads, self.max_cache_len, self.residual_length

        def entries(d: int) -> dict[str, Tensor]:
            return {"codes": torch.zeros(b, h, n, d * self.bits // 8, dtype=torch.uint8, device=self.device),
                    "scale": torch.zeros(b, h, n, d // self.group, dtype=torch.float16, device=self.device),
                    "min": torch.zeros(b, h, n, d // self.group, dtype=torch.float16, device=self.device),
                    "recent": torch.zeros(b, h, r, d, dtype=self.dtype, device=self.device)}

        self.key_store, self.value_store = entries(self.k_head_dim), entries(self.v_head_dim)
        self.keys = self.values = None  # nothing in full precision but the recent ring
        self.cumulative_length = self.cumulative_length.to(self.device)
        from transformers.utils import is_torchdynamo_compiling
        if not is_torchdynamo_compiling():
            for t in (*self.key_store.values(), *self.value_store.values(), self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def _store(self, store: dict[str, Tensor], x: Tensor, pos: Tensor, rotate: bool) -> None:
        codes, scale, mn = quantize_kv(hadamard_transform(x) if rotate else x, self.bits, self.group)
        store["codes"].index_copy_(2, pos, codes)
        store["scale"].index_copy_(2, pos, scale)
        store["min"].index_copy_(2, pos, mn)
        if self.residual_length:
            r = self.residual_length
            store["recent"].index_copy_(2, pos[-r:] % r, x[..., -r:, :].to(self.dtype))

    def _read(self, store: dict[str, Tensor], rotate: bool) -> Tensor:
        x = dequantize_kv(store["codes"], store["scale"], store["min"], self.bits)
        if rotate:
            x = hadamard_transform(x, inverse=True)
        x = x.to(self.dtype)
        if self.residual_length:
            x = overlay_recent(x, store["recent"], self.cumulative_length)
        return x

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pos = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self.cumulative_length.add_(key_states.shape[-2])
        self._store(self.key_store, key_states, pos, self.rotate_keys)
        self._store(self.value_store, value_states, pos, False)
        if self.defer_read:
            return key_states, value_states
        return self.read()

    def read(self) -> tuple[Tensor, Tensor]:
        """The whole cache dequantized: keys (rotated back) and values, [B, Hkv, max_cache_len, D]."""
        return self._read(self.key_store, self.rotate_keys), self._read(self.value_store, False)

    def attention(self, query: Tensor, mask: Optional[Tensor] = None, scale: Optional[float] = None) -> Tensor:
        """softmax(q kᵀ · scale + mask) v over the rounded cache, read by the kv_attention kernel
        (codes dequantized in registers; CPU): query [B, H, S, D] (H a multiple of the KV heads),
        mask broadcastable to [B, H, S, max_cache_len] (bool or additive; unfilled positions must
        be masked), returns [B, S, H, D]. The exact recent tokens come from the ring, as in read()."""
        if not self.is_initialized:
            raise RuntimeError("QuantizedKVLayer.attention: the cache is empty; update() it first")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        q = hadamard_transform(query) if self.rotate_keys else query  # (qH)·dequant(kH) = q·kᵀ
        k, v = self.key_store, self.value_store
        rings = ()
        if self.residual_length:  # exact rows; keys rotated like the codes (a few rows per step)
            k_ring = hadamard_transform(k["recent"]) if self.rotate_keys else k["recent"]
            rings = (k_ring, v["recent"], self.cumulative_length)
        from .ops.attention import kv_attention
        from .ops.backend import resolve_backend
        # the CPU kernel, the Triton kernel on CUDA, or with use_backend("triton") under the interpreter
        return kv_attention(q, k["codes"], k["scale"], k["min"], v["codes"], v["scale"], v["min"], mask, scale,
                            self.bits, *rings, backend=resolve_backend(q.device.type))

    def reset(self) -> None:
        if self.is_initialized:
            for t in (*self.key_store.values(), *self.value_store.values()):
                t.zero_()
        self.cumulative_length.zero_()

    def nbytes(self) -> int:
        """Bytes this layer's cache holds (codes, scales, mins and the full-precision recent ring)."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (*self.key_store.values(), *self.value_store.values()))

    def reorder_cache(self, beam_idx: Tensor) -> None:
        # in place: a compiled decode graph holds these buffers' addresses (static cache)
        for store in (self.key_store, self.value_store):
            for t in store.values():
                t.copy_(t.index_select(0, beam_idx.to(t.device)))


class QuantizedKVCache(Cache):
    """A transformers Cache with a QuantizedKVLayer per decoder layer (full-attention models only).

    bits: 4 or 8; group: channels of a head per scale (divides head_dim; 64 or 128 as in QuaRot);
    residual_length: recent tokens also kept exact (0 = every token rounded, QuaRot's evaluation);
    rotate_keys: Hadamard of the head dimension on keys before rounding (needs a supported size)."""

    def __init__(self, config, max_cache_len: int, *, bits: int = 4, group: int = 64, residual_length: int = 128,
                 rotate_keys: bool = True):
        text = config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text)
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            raise ValueError(f"QuantizedKVCache supports full-attention layers only; this model has {other} layers "
                             "(use transformers' StaticCache for it)")
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        check_kv_config(bits, group, head_dim)
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be >= 1, got {max_cache_len}")
        self.bits, self.group, self.head_dim = bits, group, head_dim
        super().__init__(layers=[QuantizedKVLayer(max_cache_len, bits=bits, group=group,
                                                  residual_length=residual_length, rotate_keys=rotate_keys)
                                 for _ in layer_types])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def bytes_per_token(self, num_kv_heads: int) -> float:
        """Rounded storage per token over all layers (without the recent ring): the memory a long cache costs."""
        return 2 * len(self.layers) * num_kv_heads * kv_bytes_per_token_head(self.head_dim, self.bits, self.group)


class VQKVLayer(StaticLayer):
    """One attention layer's vector-quantized (CQ) cache: one code byte per channel group of every
    cached key and value (formats/kv_vq.py), with this layer's fp16 codebook planes. update() returns
    the decoded cache (the reference); attention() reads the codes through kv_vq_attention."""

    def __init__(self, max_cache_len: int, k_planes: Tensor, v_planes: Tensor, **kwargs):
        super().__init__(max_cache_len=max_cache_len)
        if k_planes.shape != v_planes.shape:
            raise ValueError(f"VQ KV cache: key and value codebooks differ in shape: {tuple(k_planes.shape)} vs "
                             f"{tuple(v_planes.shape)}")
        self.k_planes, self.v_planes = k_planes, v_planes

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        from .formats.kv_vq import check_planes
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        d = key_states.shape[-1]
        check_planes(self.k_planes, d)
        if self.k_planes.shape[0] != self.num_heads or value_states.shape[-1] != d:
            raise ValueError(f"VQ KV cache: codebooks for {self.k_planes.shape[0]} KV heads of dimension "
                             f"{self.k_planes.shape[1] * self.k_planes.shape[2]}, the model has {self.num_heads} of "
                             f"{d} (keys) / {value_states.shape[-1]} (values): learn them on this model")
        self.k_planes, self.v_planes = self.k_planes.to(self.device), self.v_planes.to(self.device)
        shape = (self.batch_size, self.num_heads, self.max_cache_len, self.k_planes.shape[1])
        self.k_codes = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        self.v_codes = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        self.keys = self.values = None
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        from .formats.kv_vq import quantize_kv_vq
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pos = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self.cumulative_length.add_(key_states.shape[-2])
        self.k_codes.index_copy_(2, pos, quantize_kv_vq(key_states, self.k_planes))
        self.v_codes.index_copy_(2, pos, quantize_kv_vq(value_states, self.v_planes))
        return self.read()

    def read(self) -> tuple[Tensor, Tensor]:
        """The whole cache decoded, [B, Hkv, max_cache_len, D] in the model's dtype."""
        from .formats.kv_vq import dequantize_kv_vq
        return (dequantize_kv_vq(self.k_codes, self.k_planes).to(self.dtype),
                dequantize_kv_vq(self.v_codes, self.v_planes).to(self.dtype))

    def attention(self, query: Tensor, mask: Optional[Tensor] = None, scale: Optional[float] = None) -> Tensor:
        """softmax(q kᵀ · scale + mask) v over the codes (kv_vq_attention): query [B, H, S, D], mask
        broadcastable to [B, H, S, max_cache_len] (unfilled positions must be masked); [B, S, H, D] out."""
        if not self.is_initialized:
            raise RuntimeError("VQKVLayer.attention: the cache is empty; update() it first")
        from .ops.attention import kv_vq_attention
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return kv_vq_attention(query, self.k_codes, self.k_planes, self.v_codes, self.v_planes, mask, scale)

    def reset(self) -> None:
        if self.is_initialized:
            self.k_codes.zero_()
            self.v_codes.zero_()
        self.cumulative_length.zero_()

    def nbytes(self) -> int:
        """Bytes of the codes and this layer's codebooks."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.k_codes, self.v_codes, self.k_planes, self.v_planes))

    def reorder_cache(self, beam_idx: Tensor) -> None:
        for t in (self.k_codes, self.v_codes):
            t.copy_(t.index_select(0, beam_idx.to(t.device)))


class VQKVCache(Cache):
    """A transformers Cache of VQKVLayer's (full-attention models only), with the per-layer codebook
    planes `codebooks` [(k_planes, v_planes), ...] that learn_kv_codebooks_on(model, ...) learns."""

    def __init__(self, config, max_cache_len: int, codebooks: list[tuple[Tensor, Tensor]]):
        text = config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text)
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            raise ValueError(f"VQKVCache supports full-attention layers only; this model has {other} layers")
        if len(codebooks) != len(layer_types):
            raise ValueError(f"VQKVCache: {len(codebooks)} codebook pairs for {len(layer_types)} layers; learn them "
                             "on this model (learn_kv_codebooks_on)")
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be >= 1, got {max_cache_len}")
        super().__init__(layers=[VQKVLayer(max_cache_len, k, v) for k, v in codebooks])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


@torch.no_grad()
def learn_kv_codebooks_on(model, batches, name: str, iters: int = 12) -> list[tuple[Tensor, Tensor]]:
    """Per decoder layer, the (key, value) codebook planes of the KV quantization `name` (cq2, cq4),
    learned by k-means on the keys (after RoPE) and values the model caches for the token batches."""
    from transformers import DynamicCache

    from .formats.kv_vq import learn_kv_codebooks
    keys, values = None, None
    for ids in batches:
        cache = DynamicCache()
        model(ids, past_key_values=cache, use_cache=True)
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        if keys is None:
            keys, values = [[k] for k, _ in layers], [[v] for _, v in layers]
        else:
            for i, (k, v) in enumerate(layers):
                keys[i].append(k)
                values[i].append(v)
    if keys is None:
        raise ValueError("learn_kv_codebooks_on: no calibration batches")
    return [(learn_kv_codebooks(torch.cat(k, 2), name, iters), learn_kv_codebooks(torch.cat(v, 2), name, iters))
            for k, v in zip(keys, values)]
