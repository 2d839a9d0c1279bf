"""QuaRot's per-token symmetric activation codes and their block-scaled variants: the one definition,
at the bottom layer because the op's CPU reference (ops/library.py) and the Triton integer-activation
kernel (triton_kernels/int_act.py) round with it too; formats/activations.py re-exports it beside
ggml's Q8_0 blocks."""
from __future__ import annotations

import torch
from torch import Tensor

ACT_BITS = (2, 3, 4, 8)  # the per-token activation widths the kernels and wrappers take
# The block of block-scaled activations the int8-weight CPU kernels read (their per-32 activation
# blocks, csrc kActBlock); wider blocks are rounded in torch.
KERNEL_ACT_BLOCK = 32
# Sub-blocks of that block with two-level scales (quantize_sub_blocks), also rounded in-kernel.
SUB_BLOCKS = (8, 16)
KERNEL_ACT_BLOCKS = SUB_BLOCKS + (KERNEL_ACT_BLOCK,)


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


def sub_block_multiplier_max(bits: int) -> int:
    """kmax of quantize_sub_blocks: the largest multiplier whose product with a code fits int8 (15 at 4 bits)."""
    return 127 // 2 ** (bits - 1)


def quantize_sub_blocks(x: Tensor, bits: int, clip_ratio: float = 1.0, sub: int = 16) -> tuple[Tensor, Tensor]:
    """Block-scaled activations with two-level scales, as the int8 kernels take them (csrc
    quantize_sub_block32, bit for bit): x [..., K] (K % 32 == 0), sub 8 or 16, bits <= 4 ->
    (int8 products [..., K], fp32 d [..., K/32]). Each 32-feature block has one scale d and each sub-block
    j an integer multiplier k_j in [1, kmax] (kmax = sub_block_multiplier_max(bits)) with k_j d close to
    s_j = max|x| over the sub-block times clip / qmax (its own best scale): d = max_j s_j / kb, where kb in
    (kmax / 2, kmax] (the first from kmax down) least mismatches the worst sub-block, |k_j d - s_j| / s_j,
    k_j = clamp(round(s_j / d), 1, kmax) — the sub-scale ratios are the best fractions of denominator up to
    kmax. Codes c = clamp(round(x / (k_j d)), -2^(b-1), qmax) are stored as k_j * c, so x ~ d * (k_j c)
    (NVFP4's per-16 scales, held as integer multiples of a per-32 scale so the per-32 int8 kernels
    multiply them exactly)."""
    if sub not in SUB_BLOCKS or bits > 4:
        raise ValueError(f"quantize_sub_blocks: sub must be 8 or 16 and bits at most 4, got sub={sub}, bits={bits}")
    qmax, kmax = 2 ** (bits - 1) - 1, sub_block_multiplier_max(bits)
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32 // sub, sub)
    s = xb.abs().amax(-1, keepdim=True) * (clip_ratio / qmax)  # the python scalar is cast to fp32, as in C++
    smax = s.amax(-2, keepdim=True)
    live = smax > 0
    best = d = k = None
    for kb in range(kmax, kmax // 2, -1):
        # kb as a tensor: CUDA divides by a Python scalar as a * (1 / b), not IEEE a / b as the kernels do
        dc = torch.where(live, smax / torch.full_like(smax, kb), torch.ones_like(smax))
        kc = torch.clamp(torch.round(s / dc), 1, kmax)
        worst = torch.where(s > 0, (kc * dc - s).abs() / s, torch.zeros_like(s)).amax(-2, keepdim=True)
        if best is None:
            best, d, k = worst, dc, kc
        else:
            better = worst < best  # ties keep the larger kb, as the C++ loop
            best, d, k = torch.where(better, worst, best), torch.where(better, dc, d), torch.where(better, kc, k)
    k = torch.where(live, k, torch.ones_like(k))
    codes = torch.clamp(torch.round(xb / (k * d)), -qmax - 1, qmax)
    return (codes * k).to(torch.int8).reshape(x.shape), d.reshape(*x.shape[:-1], x.shape[-1] // 32)


def quantize_act_codes(x: Tensor, bits: int, clip_ratio: float = 1.0, block: int = 0) -> tuple[Tensor, Tensor]:
    """The integer activations the kernels multiply, for each activation block the kernels take: x [..., K]
    -> (codes int8 [..., K], fp32 d) with x ~ codes * d per token (block 0: d [..., 1],
    quantize_per_token) or per 32 features (block 32: one scale per 32; 16 / 8: quantize_sub_blocks'
    two-level scales; d [..., K / 32])."""
    if block == 0:
        return quantize_per_token(x, bits, clip_ratio)
    if block in SUB_BLOCKS:
        return quantize_sub_blocks(x, bits, clip_ratio, block)
    if block != KERNEL_ACT_BLOCK:
        raise ValueError(f"quantize_act_codes: block must be 0, 8, 16 or 32, got {block}")
    codes, d = quantize_per_token(x.reshape(*x.shape[:-1], x.shape[-1] // block, block), bits, clip_ratio)
    return codes.reshape(x.shape), d.squeeze(-1)


def dequantize_act_codes(codes: Tensor, d: Tensor) -> Tensor:
    """fp32 values codes * d of quantize_act_codes' output (d per token [..., 1] or per 32 features)."""
    if d.shape[-1] == 1:
        return codes.float() * d
    blocks = codes.float().reshape(*codes.shape[:-1], d.shape[-1], codes.shape[-1] // d.shape[-1])
    return (blocks * d.unsqueeze(-1)).reshape(codes.shape)
