"""The lut4 ops (layout lut4_rowmajor: 4-bit codes as nibbles, fp16 group scales and mins, a 16-entry
table): lut4_linear, lut4_dequantize (CPU: csrc/lut4_linear.cpp; CUDA: triton_kernels/lut4.py) and
lut4_int_linear, the integer-activation matmul (CUDA: triton_kernels/int_act.py; CPU: the reference
here). Typed wrappers, fakes, CUDA bindings, the Python CPU impl and the CPU references that stand in
for the C++ kernels where the extension is absent."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..core.activations import ACT_BITS, dequantize_act_codes, quantize_act_codes
from ._common import (FLOAT_ACTS, Backend, check, check_act_args, register_dense_cpu_impls, register_linear_fakes,
                      register_triton_cuda, route)


def lut4_linear(x: Tensor, qweight: Tensor, scales: Tensor, mins: Optional[Tensor], lut: Tensor, group_size: int,
                bias: Optional[Tensor], *, backend: Backend = "auto") -> Tensor:
    """y = x @ W.T + bias in x's dtype; qweight uint8 [N, K/2], scales (and mins) fp16 [N, K/group], lut
    the 16 fp32 code values."""
    return route("lut4_linear", "lut4", backend, x, qweight, scales, mins, lut, group_size, bias)


def lut4_dequantize(qweight: Tensor, scales: Tensor, mins: Optional[Tensor], lut: Tensor, group_size: int, *,
                    backend: Backend = "auto") -> Tensor:
    """W fp32 [N, K]."""
    return route("lut4_dequantize", "lut4", backend, qweight, scales, mins, lut, group_size)


def lut4_int_linear(x: Tensor, qweight: Tensor, scales: Tensor, mins: Optional[Tensor], lut: Tensor,
                    group_size: int, bias: Optional[Tensor], act_bits: int, act_clip: float, act_block: int = 0, *,
                    backend: Backend = "auto") -> Tensor:
    """fp32 [M, N] = q(x) @ W.T + bias, x [M, K] rounded to act_bits per token (act_block 0) or per
    block of act_block features; lut the 16 int8 code values."""
    return route("lut4_int_linear", "int_act", backend, x, qweight, scales, mins, lut, group_size, bias, act_bits,
                 act_clip, act_block)


def _lut4_check(qweight, scales, mins, lut, group_size):
    check(qweight.dtype == torch.uint8 and qweight.dim() == 2, "lut4: qweight must be 2-D uint8 [N, K/2]")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    check(group_size > 0 and group_size % 32 == 0 and k % group_size == 0,
          f"lut4: group size {group_size} must be a multiple of 32 dividing K={k}")
    check(scales.dtype == torch.float16 and tuple(scales.shape) == (n, k // group_size),
          f"lut4: scales must be fp16 [{n}, {k // group_size}]")
    if mins is not None:
        check(mins.dtype == torch.float16 and mins.shape == scales.shape, "lut4: mins must match scales")
    check(lut.dtype == torch.float32 and lut.numel() == 16, "lut4: lut must be 16 fp32 values")
    return n, k


def _lut4_int_check(x, qweight, scales, mins, lut, group_size, bias, act_bits, act_clip, act_block):
    n, k = _lut4_check(qweight, scales, mins, lut.float(), group_size)
    check(lut.dtype == torch.int8, "lut4_int_linear: lut must be the 16 int8 code values")
    check(x.dtype in FLOAT_ACTS and x.dim() == 2 and x.shape[1] == k,
          f"lut4_int_linear: x must be float [M, {k}]")
    check(act_bits in ACT_BITS and 0 < act_clip <= 1,
          "lut4_int_linear: act_bits must be 2, 3, 4 or 8 and act_clip in (0, 1]")
    check_act_args("lut4_int_linear", act_bits, act_block)
    if bias is not None:
        check(bias.dim() == 1 and bias.shape[0] == n, f"lut4_int_linear: bias must have {n} elements")
    return n, k


def register_reference_cpu_impls(decode: Callable) -> None:
    """Where the extension is absent, the CPU references of lut4_dequantize / lut4_linear: decode(in_features,
    qweight, scales, mins, lut, group_size) -> fp32 [N, K] (the format's reference decoder, from
    layouts/lut4.py) and a dense fp32 matmul."""
    register_dense_cpu_impls("lut4", _lut4_check, decode)


register_linear_fakes("lut4", _lut4_check)


@torch.library.register_fake("torch_lowbit::lut4_int_linear")
def _lut4_int_linear_fake(x, qweight, scales, mins, lut, group_size, bias, act_bits, act_clip, act_block=0):
    n, _ = _lut4_int_check(x, qweight, scales, mins, lut, group_size, bias, act_bits, act_clip, act_block)
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


@torch.library.impl("torch_lowbit::lut4_int_linear", "CPU")
def _lut4_int_linear_cpu(x, qweight, scales, mins, lut, group_size, bias, act_bits, act_clip, act_block=0):
    """The reference: x rounded per token or block (quantize_act_codes) times the dequantized weight in fp32."""
    _lut4_int_check(x, qweight, scales, mins, lut, group_size, bias, act_bits, act_clip, act_block)
    w = lut4_dequantize(qweight, scales, mins, lut.float(), group_size)
    x_hat = dequantize_act_codes(*quantize_act_codes(x, act_bits, act_clip, act_block))
    return torch.nn.functional.linear(x_hat, w, bias.float() if bias is not None else None)


register_triton_cuda("lut4", "lut4_linear", "lut4_dequantize")
register_triton_cuda("int_act", "lut4_int_linear")
