"""The gcb ops (layout gcb_rowmajor: 2- and 3-bit codes as one MSB-first stream per row, one byte per
32-weight sub-group (codebook index << 4 | sub-scale), fp16 superblock scales, int8 codebooks):
gcb_linear, gcb_dequantize. CUDA: triton_kernels/lowbit.py; CPU: no C++ kernel, the format's reference
decoder and a dense matmul (register_reference_cpu_impls, called by the layout). On the CPU the
gcb_i8_n16 tiles run lut_i8_linear instead (ops/lut_i8.py). Typed wrappers, fakes, CUDA bindings."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..core.packing import GCB_CODE_BITS
from ._common import (Backend, check, check_stream, register_dense_cpu_impls, register_linear_fakes,
                      register_triton_cuda, route)

def gcb_linear(x: Tensor, codes: Tensor, code_bits: int, sub_groups: Tensor, super_scales: Tensor,
               codebooks: Tensor, bias: Optional[Tensor], *, backend: Backend = "auto") -> Tensor:
    """y = x @ W.T + bias in x's dtype; codes int32 [N, ceil(K code_bits / 32)], sub_groups uint8
    [N, K/32], super_scales fp16 [N, K/superblock], codebooks int8 [1..16, 2^code_bits]."""
    return route("gcb_linear", "lowbit", backend, x, codes, code_bits, sub_groups, super_scales, codebooks, bias)


def gcb_dequantize(codes: Tensor, code_bits: int, sub_groups: Tensor, super_scales: Tensor, codebooks: Tensor, *,
                   backend: Backend = "auto") -> Tensor:
    """W fp32 [N, K]."""
    return route("gcb_dequantize", "lowbit", backend, codes, code_bits, sub_groups, super_scales, codebooks)


def _gcb_check(codes, code_bits, sub_groups, super_scales, codebooks):
    """gcb_rowmajor: one code stream per row, sub-group bytes, superblock scales, int8 codebooks."""
    check(code_bits in GCB_CODE_BITS, f"gcb: code_bits must be one of {GCB_CODE_BITS}, got {code_bits}")
    check(sub_groups.dtype == torch.uint8 and sub_groups.dim() == 2, "gcb: sub_groups must be 2-D uint8 [N, K/32]")
    n, k = sub_groups.shape[0], sub_groups.shape[1] * 32
    check(super_scales.dtype == torch.float16 and super_scales.dim() == 2 and super_scales.shape[0] == n
          and super_scales.shape[1] > 0 and k % super_scales.shape[1] == 0
          and (k // super_scales.shape[1]) % 32 == 0,
          f"gcb: super_scales must be fp16 [{n}, K/superblock], the superblock a multiple of 32 dividing K={k}")
    check(codebooks.dtype == torch.int8 and codebooks.dim() == 2 and codebooks.shape[1] == 2 ** code_bits
          and 1 <= codebooks.shape[0] <= 16, f"gcb: codebooks must be int8 [1..16, {2 ** code_bits}]")
    check_stream("gcb", codes, code_bits, n, k)
    return n, k


def register_reference_cpu_impls(decode: Callable) -> None:
    """CPU impls of gcb_dequantize / gcb_linear: decode(in_features, codes, code_bits, sub_groups,
    super_scales, codebooks) -> fp32 [N, K] (the format's reference decoder, from layouts/gcb.py) and a
    dense matmul."""
    register_dense_cpu_impls("gcb", _gcb_check, decode)


register_linear_fakes("gcb", _gcb_check)
register_triton_cuda("lowbit", "gcb_linear", "gcb_dequantize")
