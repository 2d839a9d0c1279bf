"""The kquant ops (layout kquant_stream: the K-quants q2_k .. q6_k off the CPU): kquant_linear,
kquant_dequantize. The codes are one MSB-first b-bit stream per row (b = 2 .. 6), the two-level scales
stay as the GGUF block holds them: int8 sub-block scales (and uint8 mins) [N, K / sub_block], fp16 d
(and dmin) per 256-weight super-block, so w = (d sub_scale) code - dmin sub_min, or
(d sub_scale) (code - code_offset) for the symmetric types. CUDA: triton_kernels/kquant.py; CPU: no
C++ kernel, the format's reference decoder and a dense matmul (the CPU runs kquant_i8_n16's tiles
through lut_i8_linear instead). Typed wrappers, fakes, CUDA bindings."""
from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor

from ..core.kquant_blocks import buffer_problem
from ._common import Backend, check, register_dense_cpu_impls, register_linear_fakes, register_triton_cuda, route


def kquant_linear(x: Tensor, codes: Tensor, code_bits: int, sub_scales: Tensor, sub_mins: Optional[Tensor],
                  d: Tensor, dmin: Optional[Tensor], sub_block: int, code_offset: int, bias: Optional[Tensor], *,
                  backend: Backend = "auto") -> Tensor:
    """y = x @ W.T + bias in x's dtype; codes int32 [N, K code_bits / 32], sub_scales int8 (sub_mins
    uint8) [N, K / sub_block], d (dmin) fp16 [N, K / 256]."""
    return route("kquant_linear", "kquant", backend, x, codes, code_bits, sub_scales, sub_mins, d, dmin, sub_block,
                 code_offset, bias)


def kquant_dequantize(codes: Tensor, code_bits: int, sub_scales: Tensor, sub_mins: Optional[Tensor], d: Tensor,
                      dmin: Optional[Tensor], sub_block: int, code_offset: int, *, backend: Backend = "auto") -> Tensor:
    """W fp32 [N, K], bit for bit the format's reference dequantizer."""
    return route("kquant_dequantize", "kquant", backend, codes, code_bits, sub_scales, sub_mins, d, dmin, sub_block,
                 code_offset)


def _check(*weights):
    problem, n, k = buffer_problem(*weights)
    check(problem is None, f"kquant: {problem}")
    return n, k


def register_reference_cpu_impls(decode: Callable) -> None:
    """CPU impls of kquant_dequantize / kquant_linear: decode(in_features, codes, code_bits, sub_scales,
    sub_mins, d, dmin, sub_block, code_offset) -> fp32 [N, K] (the format's reference decoder, from
    layouts/kquant_stream.py) and a dense matmul."""
    register_dense_cpu_impls("kquant", _check, decode)


register_linear_fakes("kquant", _check)
register_triton_cuda("kquant", "kquant_linear", "kquant_dequantize")
