"""Activation rounding, the one definition (pure torch, bottom layer: the ops' CPU references, the
Triton integer-activation kernel, the layouts and nn/act_quant.py's wrapper all round with it):

- QuaRot's per-token symmetric codes of `bits` bits and their block-scaled variants (blocks of 32, and
  sub-blocks of 16 / 8 with two-level scales), as the int8 CPU kernels and the Triton kernel round;
- asymmetric and wider-block fake quantization (rounded in torch before a layer runs) and the clip
  ratio search (`fake_quantize_per_token`, `search_clip_ratio`);
- ggml's Q8_0 activation blocks, the twins of csrc/common/act_q8.cpp: per token, per 32 consecutive
  features, d = max|x| / 127 and q = round_half_even(x * (1 / d)).
"""
from __future__ import annotations

from typing import Optional

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


CLIP_GRID = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0, 0.95, ..., 0.5


def check_act_bits(bits: int) -> None:
    if bits not in ACT_BITS:
        raise ValueError(f"activation quantization: bits must be 2, 3, 4 or 8, got {bits!r}")


def check_act_block(block: int, features: Optional[int] = None, bits: Optional[int] = None) -> None:
    if not isinstance(block, int) or block < 0 or (block and block not in SUB_BLOCKS and block % KERNEL_ACT_BLOCK):
        raise ValueError(f"activation quantization: block must be 0 (one scale per token), 16 or 8 (two-level scales "
                         f"inside blocks of 32) or a multiple of 32; got {block!r}")
    if block in SUB_BLOCKS and bits is not None and bits > 4:
        raise ValueError(f"activation quantization: blocks of {block} need at most 4 bits (the int8 kernels hold "
                         f"their codes times an integer sub-block scale); got {bits} bits: use block 32 or 0")
    if block and features is not None and features % max(block, KERNEL_ACT_BLOCK):
        raise ValueError(f"activation quantization: block {block} does not divide the layer's {features} input "
                         "features into whole blocks of 32; pick a block dividing it (16 or 32) or block=0 (per token)")


def fake_quantize_per_token(x: Tensor, bits: int, symmetric: bool = True, clip_ratio: float = 1.0,
                            block: int = 0) -> Tensor:
    """x [..., K] rounded per token (last dim; block > 0: per block of that many features of a token)
    to `bits`; returns dequantized values in x's dtype."""
    check_act_bits(bits)
    if not 0 < clip_ratio <= 1:
        raise ValueError(f"activation quantization: clip_ratio must be in (0, 1], got {clip_ratio}")
    if block:
        check_act_block(block, x.shape[-1], bits if symmetric else None)
        if block in KERNEL_ACT_BLOCKS and symmetric:  # the codes the kernels take (act_codes)
            return dequantize_act_codes(*quantize_act_codes(x, bits, clip_ratio, block)).to(x.dtype)
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
        return fake_quantize_per_token(blocks, bits, symmetric, clip_ratio).reshape(x.shape)
    xf = x.float()
    if symmetric:
        codes, d = quantize_per_token(xf, bits, clip_ratio)
        return (codes.float() * d).to(x.dtype)
    qmax = 2 ** bits - 1
    hi, lo = xf.amax(-1, keepdim=True) * clip_ratio, xf.amin(-1, keepdim=True) * clip_ratio
    d = (hi - lo) / qmax
    d = torch.where(d > 0, d, torch.ones_like(d))
    zero = torch.round(-lo / d)
    return ((torch.clamp(torch.round(xf / d) + zero, 0, qmax) - zero) * d).to(x.dtype)


def search_clip_ratio(samples: Tensor, bits: int, symmetric: bool = True, grid=CLIP_GRID, block: int = 0) -> float:
    """The ratio of `grid` whose per-token (per-block) quantization of samples [T, K] has the least squared error."""
    errors = [(fake_quantize_per_token(samples, bits, symmetric, c, block) - samples).float().square().sum().item()
              for c in grid]
    return float(grid[min(range(len(grid)), key=errors.__getitem__)])


# ggml's Q8_0 activation blocks (the int8 kernels' dynamic activations)
Q8_ACT_BLOCK = 32


def quantize_q8_blocks(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] (K % 32 == 0) -> (int8 codes [..., K], fp32 scales [..., K/32])."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // Q8_ACT_BLOCK, Q8_ACT_BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv)  # torch.round is half-to-even, as the kernels' rounding mode
    return q.to(torch.int8).reshape(x.shape), d.squeeze(-1)


def fake_quantize_q8_blocks(x: Tensor) -> Tensor:
    """The fp32 activations an int8 kernel effectively multiplies with (q * d)."""
    q, d = quantize_q8_blocks(x)
    qb = q.float().reshape(*x.shape[:-1], x.shape[-1] // Q8_ACT_BLOCK, Q8_ACT_BLOCK)
    return (qb * d.unsqueeze(-1)).reshape(x.shape)


def fake_quantize_q8_pair_blocks(x: Tensor) -> Tensor:
    """fake_quantize_q8_blocks in the pair-split order of the 2-D codebook kernels (lut_i8's pair mode,
    vq_i8_n16): per 64 features, the 32 first coordinates of the pairs form one block, the 32 second
    ones the next."""
    lead, k = x.shape[:-1], x.shape[-1]
    split = x.reshape(*lead, k // 64, 32, 2).transpose(-1, -2).reshape(*lead, k)
    q = fake_quantize_q8_blocks(split)
    return q.reshape(*lead, k // 64, 2, 32).transpose(-1, -2).reshape(*lead, k)


def int8_kernel_activations(x: Tensor, act_bits: int = 0, act_clip: float = 1.0, act_block: int = 0,
                            pairs: bool = False) -> Tensor:
    """The fp32 activations the int8-weight CPU kernels (lut_i8_linear, q4x_linear) multiply, as they take
    them: act_bits 0, their own Q8_0 blocks (pairs: in pair-split order); else x rounded to act_bits per
    token (act_block 0) or per block (quantize_act_codes)."""
    if act_bits == 0:
        return fake_quantize_q8_pair_blocks(x) if pairs else fake_quantize_q8_blocks(x)
    return dequantize_act_codes(*quantize_act_codes(x, act_bits, act_clip, act_block))
