"""The lowbit ops (layout stream_rowmajor: 1-, 2-, 3- and 8-bit codes as one MSB-first stream per row,
fp16 group scales and mins, the format's fp32 table): lowbit_linear, lowbit_dequantize. CUDA:
triton_kernels/lowbit.py; CPU: no C++ kernel, the format's reference decoder and a dense matmul
(register_reference_cpu_impls, called by the layout). Typed wrappers, fakes, CUDA bindings."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..core.packing import STREAM_CODE_BITS
from ._common import (Backend, check, check_stream, register_dense_cpu_impls, register_linear_fakes,
                      register_triton_cuda, route)

def lowbit_linear(x: Tensor, codes: Tensor, code_bits: int, scales: Tensor, mins: Optional[Tensor], lut: Tensor,
                  group_size: int, bias: Optional[Tensor], *, backend: Backend = "auto") -> Tensor:
    """y = x @ W.T + bias in x's dtype; codes int32 [N, ceil(K code_bits / 32)], scales (and mins) fp16
    [N, K/group], lut the 2^code_bits fp32 code values."""
    return route("lowbit_linear", "lowbit", backend, x, codes, code_bits, scales, mins, lut, group_size, bias)


def lowbit_dequantize(codes: Tensor, code_bits: int, scales: Tensor, mins: Optional[Tensor], lut: Tensor,
                      group_size: int, *, backend: Backend = "auto") -> Tensor:
    """W fp32 [N, K]."""
    return route("lowbit_dequantize", "lowbit", backend, codes, code_bits, scales, mins, lut, group_size)


def _lowbit_check(codes, code_bits, scales, mins, lut, group_size):
    """stream_rowmajor: one code stream per row, fp16 group scales (and mins)."""
    check(code_bits in STREAM_CODE_BITS, f"lowbit: code_bits must be one of {STREAM_CODE_BITS}, got {code_bits}")
    check(group_size > 0 and group_size % 32 == 0, f"lowbit: group size {group_size} must be a multiple of 32")
    check(scales.dtype == torch.float16 and scales.dim() == 2, "lowbit: scales must be 2-D fp16 [N, K/group]")
    n, k = scales.shape[0], scales.shape[1] * group_size
    if mins is not None:
        check(mins.dtype == torch.float16 and mins.shape == scales.shape, "lowbit: mins must match scales")
    check(lut.dtype == torch.float32 and lut.numel() == 2 ** code_bits,
          f"lowbit: lut must be {2 ** code_bits} fp32 values")
    check_stream("lowbit", codes, code_bits, n, k)
    return n, k


def register_reference_cpu_impls(decode: Callable) -> None:
    """CPU impls of lowbit_dequantize / lowbit_linear: decode(in_features, codes, code_bits, scales, mins,
    lut, group_size) -> fp32 [N, K] (the format's reference decoder, from layouts/stream_rowmajor.py)
    and a dense matmul."""
    register_dense_cpu_impls("lowbit", _lowbit_check, decode)


register_linear_fakes("lowbit", _lowbit_check)
register_triton_cuda("lowbit", "lowbit_linear", "lowbit_dequantize")
