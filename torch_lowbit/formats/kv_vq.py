"""Vector-quantized KV-cache entries: coupled quantization (CQ), VQ-LLM's KV configurations.

Each KV head's channels are cut into groups of `vec` adjacent channels; every group of every head has
its own codebook of 2^bits entries (fp16), learned by k-means (formats/gvq.py's) on keys and values
collected from calibration text; a cached token stores one code byte per group. Named:

    cq4  VQ<2, 8, 1>: pairs of channels, 256 entries, 4 bits per channel
    cq2  VQ<4, 8, 1>: groups of 4 channels, 256 entries, 2 bits per channel

Codebooks are kept as planes [Hkv, groups, vec, entries] (coordinate d of every entry contiguous:
what the attention kernel reads, csrc/common/kv_vq.h). Keys are best learned after RoPE (what the cache
holds).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..ops.attention import register_kv_vq_reference_cpu_impl
from .gvq import kmeans

KV_VQ_CONFIGS = {"cq4": (2, 8), "cq2": (4, 8)}  # name -> (channels per group, code bits)


def kv_vq_config(name: str) -> tuple[int, int]:
    if name not in KV_VQ_CONFIGS:
        raise ValueError(f"unknown KV vector quantization {name!r}; choose one of {', '.join(KV_VQ_CONFIGS)}")
    return KV_VQ_CONFIGS[name]


def kv_vq_bits_per_channel(name: str) -> float:
    vec, bits = kv_vq_config(name)
    return bits / vec


def learn_kv_codebooks(x: Tensor, name: str, iters: int = 12, seed: int = 0) -> Tensor:
    """fp16 planes [Hkv, D / vec, vec, 2^bits] learned from samples x [..., Hkv, T, D] (keys or values of
    calibration tokens: every leading dimension and T pooled per head)."""
    vec, bits = kv_vq_config(name)
    if x.dim() < 3 or x.shape[-1] % vec:
        raise ValueError(f"{name}: samples must be [..., KV heads, tokens, D] with D a multiple of {vec}, "
                         f"got {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: calibration keys/values hold NaN/Inf")
    hkv, d = x.shape[-3], x.shape[-1]
    per_head = x.detach().float().movedim(-3, 0).reshape(hkv, -1, d)
    gen = torch.Generator().manual_seed(seed)
    planes = torch.empty(hkv, d // vec, vec, 2 ** bits)
    for h in range(hkv):
        for g in range(d // vec):
            samples = per_head[h, :, g * vec:(g + 1) * vec].contiguous()
            planes[h, g] = kmeans(samples, None, 2 ** bits, iters, gen).T.cpu()
    return planes.half().to(x.device)


def check_planes(planes: Tensor, head_dim: int) -> None:
    if planes.dim() != 4 or planes.dtype != torch.float16 or planes.shape[1] * planes.shape[2] != head_dim \
            or planes.shape[3] > 256:
        raise ValueError(f"KV codebooks must be fp16 planes [KV heads, groups, vec, <= 256 entries] covering the "
                         f"head dimension {head_dim}, got {planes.dtype} {tuple(planes.shape)}")


def quantize_kv_vq(x: Tensor, planes: Tensor) -> Tensor:
    """x [..., Hkv, T, D] -> codes uint8 [..., Hkv, T, D / vec]: each group's nearest entry, every head
    and group searched at once (a cache update runs this per layer and step)."""
    check_planes(planes, x.shape[-1])
    hkv, groups, vec, entries = planes.shape
    if x.shape[-3] != hkv:
        raise ValueError(f"KV codebooks are for {hkv} KV heads, the cache has {x.shape[-3]}")
    lead, t = x.shape[:-3], x.shape[-2]
    # [Hkv, G, M, vec] samples against [Hkv, G, vec, E] planes: |c|^2 - 2 x.c, argmin over E
    xs = x.detach().float().movedim(-3, 0).reshape(hkv, -1, groups, vec).transpose(1, 2)
    books = planes.float()
    norms = (books * books).sum(2, keepdim=True)  # [Hkv, G, 1, E]
    codes = torch.empty(xs.shape[:3], dtype=torch.uint8, device=x.device)
    step = max(1, (1 << 24) // (hkv * groups * entries))
    for s in range(0, xs.shape[2], step):
        codes[:, :, s:s + step] = (norms - 2 * xs[:, :, s:s + step] @ books).argmin(-1).to(torch.uint8)
    # [Hkv, G, M] -> [..., Hkv, T, G]
    return codes.transpose(1, 2).reshape(hkv, *lead, t, groups).movedim(0, -3).contiguous()


def dequantize_kv_vq(codes: Tensor, planes: Tensor) -> Tensor:
    """The inverse of quantize_kv_vq: fp32 [..., Hkv, T, D]."""
    hkv, groups, vec, entries = planes.shape
    books = planes.float().transpose(2, 3)  # [Hkv, groups, entries, vec]
    head = torch.arange(hkv, device=codes.device).view(hkv, 1, 1)
    group = torch.arange(groups, device=codes.device)
    values = books[head, group, codes.long()]  # [..., Hkv, T, groups, vec]
    return values.reshape(*codes.shape[:-1], groups * vec)


register_kv_vq_reference_cpu_impl(dequantize_kv_vq)
