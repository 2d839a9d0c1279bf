"""The lut_i8 op (layouts lut{b}_i8_n16, nuq_i8_n16, vq_i8_n16, gcb_i8_n16, kquant_i8_n16: b-bit codes
in 16-row tiles, integer tables, int8 activations): lut_i8_linear, a CPU-only op (csrc/lut_i8_linear.cpp).
Its typed wrapper, fake, and the CPU reference that stands in for the kernel where the extension is
absent."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..core.activations import int8_kernel_activations
from ..core.packing import GCB_CODE_BITS, LUT_I8_CODE_BITS
from ._common import Backend, check, check_act_args, dense_linear, linear_out, register_reference_cpu_impl, route

def lut_i8_linear(x: Tensor, qweight: Tensor, scales: Tensor, mins: Optional[Tensor], lut: Tensor, code_bits: int,
                  group_size: int, out_features: int, bias: Optional[Tensor], sub_groups: Optional[Tensor] = None,
                  act_bits: int = 0, act_clip: float = 1.0, act_block: int = 0,
                  sub_scales: Optional[Tensor] = None, sub_mins: Optional[Tensor] = None, *,
                  backend: Backend = "auto") -> Tensor:
    """y = x @ W.T + bias in x's dtype; qweight uint8 [N/16, K/32, 64 code_bits] (pair codebooks: K/64),
    scales (and mins) fp16 [N/16, K/group, 16]; lut the int8 table [2^code_bits] (a 2-D [2, 2^code_bits]:
    one table per coordinate of a pair; with sub_groups uint8 [N/16, K/32, 16]: up to 16 tables, one
    picked per row and 32 features). x is rounded to int8 per 32 features, or with act_bits per token
    (act_block 0) or per block of act_block features. K-quants: sub_scales int8 [N/16, K/sub, 16] (sub 16
    or 32) weight each sub-block, sub_mins uint8 (same shape) with mins = -dmin, so
    w = scale * sub_scale * lut[code] + min * sub_min (csrc/common/lut_i8.h)."""
    return route("lut_i8_linear", None, backend, x, qweight, scales, mins, lut, code_bits, group_size, out_features,
                 bias, sub_groups, act_bits, act_clip, act_block, sub_scales, sub_mins)


def _lut_i8_check(qweight, scales, mins, lut, code_bits, group_size, out_features, sub_groups, act_bits,
                  act_block, sub_scales=None, sub_mins=None) -> int:
    """The weights' and activation arguments' checks; K."""
    check(code_bits in LUT_I8_CODE_BITS, f"lut_i8: code_bits must be one of {LUT_I8_CODE_BITS}, got {code_bits}")
    check_act_args("lut_i8", act_bits, act_block)
    pairs = lut.dim() == 2  # a 2-D codebook: one code per pair of features, one table per coordinate
    check(qweight.dtype == torch.uint8 and qweight.dim() == 3 and qweight.shape[2] == 64 * code_bits,
          f"lut_i8: qweight must be uint8 [N/16, K/{64 if pairs else 32}, {64 * code_bits}] for "
          f"{code_bits}-bit codes")
    tiles, k = qweight.shape[0], qweight.shape[1] * (64 if pairs else 32)
    check(out_features <= tiles * 16 and out_features > (tiles - 1) * 16,
          f"lut_i8: out_features {out_features} does not fit {tiles} tiles of 16 rows")
    check(group_size > 0 and group_size % 32 == 0 and k % group_size == 0,
          f"lut_i8: group size {group_size} must be a multiple of 32 dividing K={k}")
    check(scales.dtype == torch.float16 and tuple(scales.shape) == (tiles, k // group_size, 16),
          f"lut_i8: scales must be fp16 [{tiles}, {k // group_size}, 16]")
    if mins is not None:
        check(mins.dtype == torch.float16 and mins.shape == scales.shape, "lut_i8: mins must match scales")
    if pairs:
        check(lut.dtype == torch.int8 and tuple(lut.shape) == (2, 2 ** code_bits) and code_bits <= 4
              and sub_groups is None and group_size % 64 == 0 and act_bits == 0,
              f"lut_i8: a pair codebook needs an int8 [2, {2 ** code_bits}] lut, codes of at most 4 bits, "
              "no sub_groups, groups of 64k and act_bits 0")
    elif sub_groups is None:
        check(lut.dtype == torch.int8 and lut.dim() == 1 and lut.numel() == 2 ** code_bits,
              f"lut_i8: lut must be {2 ** code_bits} int8 values")
    else:
        check(code_bits in GCB_CODE_BITS and mins is None,
              f"lut_i8: group codebooks need codes of {GCB_CODE_BITS} bits and no mins")
        check(sub_groups.dtype == torch.uint8 and tuple(sub_groups.shape) == (tiles, k // 32, 16),
              f"lut_i8: sub_groups must be uint8 [{tiles}, {k // 32}, 16]")
        check(lut.dtype == torch.int8 and 0 < lut.numel() <= 16 * 2 ** code_bits
              and lut.numel() % 2 ** code_bits == 0,
              f"lut_i8: lut must be 1..16 int8 codebooks of {2 ** code_bits} entries")
    if sub_scales is not None:
        check(not pairs and sub_groups is None and code_bits != 8 and act_bits == 0,
              "lut_i8: sub_scales take one table of codes up to 6 bits, no pairs or sub_groups, act_bits 0")
        check(sub_scales.dtype == torch.int8 and sub_scales.dim() == 3 and sub_scales.shape[0] == tiles
              and sub_scales.shape[2] == 16 and sub_scales.shape[1] in (k // 16, k // 32)
              and group_size % (k // sub_scales.shape[1]) == 0,
              f"lut_i8: sub_scales must be int8 [{tiles}, K/16 or K/32, 16] with K={k}, sub-blocks dividing the group")
        check((sub_mins is None) == (mins is None), "lut_i8: sub_mins and mins come together")
        check(sub_mins is None or (sub_mins.dtype == torch.uint8 and sub_mins.shape == sub_scales.shape),
              "lut_i8: sub_mins must be uint8 shaped as sub_scales")
    else:
        check(sub_mins is None, "lut_i8: sub_mins need sub_scales")
    return k


@torch.library.register_fake("torch_lowbit::lut_i8_linear")
def _lut_i8_linear_fake(x, qweight, scales, mins, lut, code_bits, group_size, out_features, bias,
                        sub_groups=None, act_bits=0, act_clip=1.0, act_block=0, sub_scales=None, sub_mins=None):
    k = _lut_i8_check(qweight, scales, mins, lut, code_bits, group_size, out_features, sub_groups, act_bits, act_block,
                      sub_scales, sub_mins)
    return linear_out("lut_i8_linear", x, out_features, k, bias)


def register_reference_cpu_impls(decode: Callable) -> None:
    """Where the extension is absent, the CPU reference of lut_i8_linear: decode(qweight, scales, mins, lut,
    code_bits, group_size, out_features, sub_groups, sub_scales, sub_mins) -> fp32 W [N, K] (the tiles'
    reference decoder, from layouts/lut_i8.py) times the activations as the kernel rounds them
    (core.activations)."""
    def reference(x, qweight, scales, mins, lut, code_bits, group_size, out_features, bias, sub_groups=None,
                  act_bits=0, act_clip=1.0, act_block=0, sub_scales=None, sub_mins=None):
        k = _lut_i8_check(qweight, scales, mins, lut, code_bits, group_size, out_features, sub_groups, act_bits,
                          act_block, sub_scales, sub_mins)
        linear_out("lut_i8_linear", x, out_features, k, bias)
        w = decode(qweight, scales, mins, lut, code_bits, group_size, out_features, sub_groups, sub_scales, sub_mins)
        return dense_linear(int8_kernel_activations(x, act_bits, act_clip, act_block, pairs=lut.dim() == 2), w, bias)

    register_reference_cpu_impl("lut_i8_linear", reference)
