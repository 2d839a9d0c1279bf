"""The q4x op (layouts q4_{R}x{S}: ARM's interleaved 4-bit rows, an int8 table, no mins): q4x_linear,
a CPU-only op (csrc/q4x_linear.cpp; NEON / dotprod / i8mm code in csrc/arm/). Its typed wrapper, fake,
and the CPU reference that stands in for the kernel where the extension is absent."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..core.activations import int8_kernel_activations
from ._common import Backend, check, check_act_args, dense_linear, linear_out, register_reference_cpu_impl, route

def q4x_linear(x: Tensor, qweight: Tensor, scales: Tensor, lut: Tensor, rows: int, chunk: int, group_size: int,
               out_features: int, bias: Optional[Tensor], act_bits: int = 0, act_clip: float = 1.0,
               act_block: int = 0, *, backend: Backend = "auto") -> Tensor:
    """y = x @ W.T + bias in x's dtype; qweight uint8 [N/rows, K/32, 16 rows] in chunks of `chunk` bytes,
    scales fp16 [N/rows, K/group, rows], lut the 16 int8 code values; x rounded to int8 per 32 features,
    or with act_bits per token (act_block 0) or per block of act_block features."""
    return route("q4x_linear", None, backend, x, qweight, scales, lut, rows, chunk, group_size, out_features, bias,
                 act_bits, act_clip, act_block)


def _q4x_check(qweight, scales, lut, rows, chunk, group_size, out_features, act_bits, act_block) -> int:
    """The weights' and activation arguments' checks; K."""
    check(rows in (4, 8) and chunk in (4, 8), f"q4x: rows and chunk must be 4 or 8, got {rows}, {chunk}")
    check_act_args("q4x", act_bits, act_block)
    check(qweight.dtype == torch.uint8 and qweight.dim() == 3 and qweight.shape[2] == 16 * rows,
          f"q4x: qweight must be uint8 [N/{rows}, K/32, {16 * rows}]")
    groups, k = qweight.shape[0], qweight.shape[1] * 32
    check((groups - 1) * rows < out_features <= groups * rows,
          f"q4x: out_features {out_features} does not fit {groups} groups of {rows} rows")
    check(group_size > 0 and group_size % 32 == 0 and k % group_size == 0,
          f"q4x: group size {group_size} must be a multiple of 32 dividing K={k}")
    check(scales.dtype == torch.float16 and tuple(scales.shape) == (groups, k // group_size, rows),
          f"q4x: scales must be fp16 [{groups}, {k // group_size}, {rows}]")
    check(lut.dtype == torch.int8 and lut.numel() == 16, "q4x: lut must be 16 int8 values")
    return k


@torch.library.register_fake("torch_lowbit::q4x_linear")
def _q4x_linear_fake(x, qweight, scales, lut, rows, chunk, group_size, out_features, bias, act_bits=0,
                     act_clip=1.0, act_block=0):
    k = _q4x_check(qweight, scales, lut, rows, chunk, group_size, out_features, act_bits, act_block)
    return linear_out("q4x_linear", x, out_features, k, bias)


def register_reference_cpu_impls(decode: Callable) -> None:
    """Where the extension is absent, the CPU reference of q4x_linear: decode(qweight, scales, lut, rows, chunk,
    group_size, out_features) -> fp32 W [N, K] (the interleaving's reference decoder, from layouts/q4x.py)
    times the activations as the kernel rounds them (core.activations)."""
    def reference(x, qweight, scales, lut, rows, chunk, group_size, out_features, bias, act_bits=0, act_clip=1.0,
                  act_block=0):
        k = _q4x_check(qweight, scales, lut, rows, chunk, group_size, out_features, act_bits, act_block)
        linear_out("q4x_linear", x, out_features, k, bias)
        w = decode(qweight, scales, lut, rows, chunk, group_size, out_features)
        return dense_linear(int8_kernel_activations(x, act_bits, act_clip, act_block), w, bias)

    register_reference_cpu_impl("q4x_linear", reference)
