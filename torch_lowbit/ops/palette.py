"""The palette ops (layout palette_packed: the Q-Palette formats nuq*, vq*, tcq*, half-TCQ):
codebook_linear / codebook_dequantize (nuq/vq codes in 16 round-robin bit streams per row),
tcq_linear / tcq_dequantize (trellis codes in 16 x 16 tiles), tcq_half_linear (half-TCQ: both halves
of K in one op) and tcq_viterbi (the trellis search of TCQ quantization). CPU: csrc/palette_linear.cpp,
csrc/tcq_viterbi.cpp, and tcq_half_linear's two tcq_linear calls here; CUDA: triton_kernels/palette.py.
Typed wrappers, fakes, CUDA bindings, the Python CPU impl and the CPU references that stand in for the
C++ kernels where the extension is absent."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..core.tcq_codes import kernel_table_shape
from ._common import (Backend, check, dense_linear, linear_out, register_dense_cpu_impls, register_linear_fakes,
                      register_reference_cpu_impl, register_triton_cuda, route)

def codebook_linear(x: Tensor, codes: Tensor, code_bits: int, table: Tensor, row_scales: Tensor,
                    bias: Optional[Tensor], *, backend: Backend = "auto") -> Tensor:
    """y = x @ W'.T + bias in x's dtype (x already rotated); codes int32 [N, 16 stream words], table fp32
    [2^code_bits, d] (d = 1: nuq, 2: vq), row_scales fp16 [N]."""
    return route("codebook_linear", "palette", backend, x, codes, code_bits, table, row_scales, bias)


def codebook_dequantize(codes: Tensor, code_bits: int, table: Tensor, row_scales: Tensor, in_features: int, *,
                        backend: Backend = "auto") -> Tensor:
    """W' fp32 [N, in_features]."""
    return route("codebook_dequantize", "palette", backend, codes, code_bits, table, row_scales, in_features)


def tcq_linear(x: Tensor, codes: Tensor, table: Tensor, table_bits: int, shift_bits: int, row_scales: Tensor,
               bias: Optional[Tensor], *, backend: Backend = "auto") -> Tensor:
    """y = x @ W'.T + bias in x's dtype (x already rotated); codes int32 [N/16, K/16, 4 shift_bits], table
    the fp32 signed table [2^(table_bits+1), 2] (table_bits 0: the 1mad code, [0, 2])."""
    return route("tcq_linear", "palette", backend, x, codes, table, table_bits, shift_bits, row_scales, bias)


def tcq_dequantize(codes: Tensor, table: Tensor, table_bits: int, shift_bits: int, row_scales: Tensor, *,
                   backend: Backend = "auto") -> Tensor:
    """W' fp32 [N, K]."""
    return route("tcq_dequantize", "palette", backend, codes, table, table_bits, shift_bits, row_scales)


def tcq_half_linear(x: Tensor, codes_lo: Tensor, table_lo: Tensor, table_bits_lo: int, shift_bits_lo: int,
                    codes_hi: Tensor, table_hi: Tensor, table_bits_hi: int, shift_bits_hi: int, row_scales: Tensor,
                    bias: Optional[Tensor], *, backend: Backend = "auto") -> Tensor:
    """tcq_linear over the first K_lo features (codes_lo) plus tcq_linear over the rest (codes_hi)."""
    return route("tcq_half_linear", "palette", backend, x, codes_lo, table_lo, table_bits_lo, shift_bits_lo,
                 codes_hi, table_hi, table_bits_hi, shift_bits_hi, row_scales, bias)


def tcq_viterbi(sequences: Tensor, state_values: Tensor, shift_bits: int) -> tuple[Tensor, Tensor]:
    """The tail-biting Viterbi of TCQ sequences fp32 [B, 256] (CPU only: csrc/tcq_viterbi.cpp, or the
    reference of formats/tcq.py without the extension): (states
    int32 [B, 128], squared errors fp32 [B]); formats/tcq.py's tcq_viterbi hands it the code's state values."""
    return torch.ops.torch_lowbit.tcq_viterbi(sequences, state_values, shift_bits)


def _codebook_check(codes, code_bits, table, row_scales, in_features):
    """palette_packed nuq/vq codes: 16 interleaved bit streams per row (csrc/common/palette.h)."""
    check(1 <= code_bits <= 12, f"codebook: code_bits must be 1..12, got {code_bits}")
    check(table.dtype == torch.float32 and table.dim() == 2 and table.shape[0] == 2 ** code_bits
          and table.shape[1] in (1, 2), "codebook: table must be fp32 [2^code_bits, 1 or 2]")
    d = table.shape[1]
    check(in_features % d == 0, f"codebook: in_features {in_features} must be a multiple of {d}")
    per_stream = -(-(in_features // d) // 16)
    words = 16 * -(-per_stream * code_bits // 32)
    check(codes.dtype == torch.int32 and codes.dim() == 2 and codes.shape[1] == words,
          f"codebook: codes must be int32 [N, {words}]")
    n = codes.shape[0]
    check(row_scales.dtype == torch.float16 and tuple(row_scales.shape) == (n,),
          f"codebook: row_scales must be fp16 [{n}]")
    return n, in_features


def _tcq_check(codes, table, table_bits, shift_bits, row_scales):
    check(3 <= shift_bits <= 10, f"tcq: shift_bits must be 3..10, got {shift_bits}")
    check(0 <= table_bits <= 15 and table.dtype == torch.float32
          and tuple(table.shape) == kernel_table_shape(table_bits),
          "tcq: table must be the fp32 signed table [2^(table_bits+1), 2] (table_bits 0: the 1mad code, [0, 2])")
    check(codes.dtype == torch.int32 and codes.dim() == 3 and codes.shape[2] == 4 * shift_bits,
          f"tcq: codes must be int32 [N/16, K/16, {4 * shift_bits}]")
    n, k = codes.shape[0] * 16, codes.shape[1] * 16
    check(row_scales.dtype == torch.float16 and tuple(row_scales.shape) == (n,), f"tcq: row_scales must be fp16 [{n}]")
    return n, k


register_linear_fakes("tcq", _tcq_check)


def register_reference_cpu_impls(decode_codebook: Callable, decode_tcq: Callable) -> None:
    """Where the extension is absent, the CPU references of codebook_* and tcq_*: the layout's reference
    decoders (layouts/palette_packed.py) decode_codebook(codes, code_bits, table, row_scales, in_features)
    and decode_tcq(in_features, codes, table, table_bits, shift_bits, row_scales) -> fp32 W' [N, K], and
    a dense fp32 matmul."""
    def codebook_dequantize_reference(codes, code_bits, table, row_scales, in_features):
        _codebook_check(codes, code_bits, table, row_scales, in_features)
        return decode_codebook(codes, code_bits, table, row_scales, in_features)

    def codebook_linear_reference(x, codes, code_bits, table, row_scales, bias):
        w = codebook_dequantize_reference(codes, code_bits, table, row_scales, x.shape[-1])
        linear_out("codebook_linear", x, w.shape[0], w.shape[1], bias)
        return dense_linear(x, w, bias)

    register_reference_cpu_impl("codebook_dequantize", codebook_dequantize_reference)
    register_reference_cpu_impl("codebook_linear", codebook_linear_reference)
    register_dense_cpu_impls("tcq", _tcq_check, decode_tcq)


def register_viterbi_reference(viterbi: Callable) -> None:
    """Where the extension is absent, tcq_viterbi's CPU reference: viterbi(sequences, state_values,
    shift_bits) -> (states, errors), formats/tcq.py's pure-torch Viterbi."""
    register_reference_cpu_impl("tcq_viterbi", viterbi)


@torch.library.register_fake("torch_lowbit::codebook_linear")
def _codebook_linear_fake(x, codes, code_bits, table, row_scales, bias):
    n, k = _codebook_check(codes, code_bits, table, row_scales, x.shape[-1])
    return linear_out("codebook_linear", x, n, k, bias)


@torch.library.register_fake("torch_lowbit::codebook_dequantize")
def _codebook_dequantize_fake(codes, code_bits, table, row_scales, in_features):
    n, k = _codebook_check(codes, code_bits, table, row_scales, in_features)
    return codes.new_empty((n, k), dtype=torch.float32)


@torch.library.register_fake("torch_lowbit::tcq_half_linear")
def _tcq_half_linear_fake(x, codes_lo, table_lo, table_bits_lo, shift_bits_lo, codes_hi, table_hi,
                          table_bits_hi, shift_bits_hi, row_scales, bias):
    n, k_lo = _tcq_check(codes_lo, table_lo, table_bits_lo, shift_bits_lo, row_scales)
    n_hi, k_hi = _tcq_check(codes_hi, table_hi, table_bits_hi, shift_bits_hi, row_scales)
    check(n_hi == n, f"tcq_half_linear: both halves' codes must have {n} rows")
    return linear_out("tcq_half_linear", x, n, k_lo + k_hi, bias)


@torch.library.impl("torch_lowbit::tcq_half_linear", "CPU")
def _tcq_half_linear_cpu(x, codes_lo, table_lo, table_bits_lo, shift_bits_lo, codes_hi, table_hi,
                         table_bits_hi, shift_bits_hi, row_scales, bias):
    k_lo = codes_lo.shape[1] * 16
    y = tcq_linear(x[..., :k_lo], codes_lo, table_lo, table_bits_lo, shift_bits_lo, row_scales, None)
    return y + tcq_linear(x[..., k_lo:], codes_hi, table_hi, table_bits_hi, shift_bits_hi, row_scales, bias)


register_triton_cuda("palette", "codebook_linear", "codebook_dequantize", "tcq_linear", "tcq_dequantize",
                     "tcq_half_linear")
