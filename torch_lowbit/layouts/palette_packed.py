"""palette_packed: the CPU kernel layout of the Q-Palette formats (nuq*, vq*, tcq*, half-TCQ).

Codes take exactly their bits: nuq/vq codes (b = bits for nuq, 2 * bits for vq: one code per pair)
are dealt round-robin to 16 MSB-first bit streams per row (code j to stream j % 16), word w of
stream l stored at column 16 w + l, so 16 consecutive codes share one bit offset in 16 adjacent
words (csrc/common/palette.h); TCQ codes are already packed that way per 16 x 16 tile and are kept as
the format stores them (both halves of half-TCQ). row_scales and signs are the format's own.

The forward rotates the activations (x' = (x * s) @ H) and calls the fused decode-matmul ops
codebook_linear, tcq_linear and tcq_half_linear (half-TCQ), whose tables come from the format
(codebook values; TCQ's signed hybrid-code table, an empty one for the computed 1mad code) as
runtime buffers. CPU backend: the C++ kernels
(csrc/palette_linear.cpp), fp32 end to end: the codebooks are not integer grids, so there is no
int8-activation path (nuq has one: nuq_i8_n16). Triton backend (triton_kernels/palette.py, the
ops' CUDA impls): x' in x's dtype (the Triton Hadamard kernel), fp16/bf16 tensor cores.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..formats import tcq
from ..formats.palette import NUQ, TCQ, VQ, PaletteFormat, HalfTCQ, codebook_decode, scale_rows, tcq_decode_tiles
from ..core.packing import pack_streams, stream_words, unpack_streams
from ..ops import Backend
from ..ops.palette import codebook_linear, register_reference_cpu_impls, tcq_half_linear, tcq_linear
from ..rotations import hadamard_transform
from .base import Layout, register_layout


def _fused_op(fmt: PaletteFormat) -> str:
    """The one fused decode-matmul op of a palette format (half-TCQ: both halves of K in one op)."""
    if isinstance(fmt, HalfTCQ):
        return "tcq_half_linear"
    return "tcq_linear" if isinstance(fmt, TCQ) else "codebook_linear"


def _code_bits(fmt: PaletteFormat) -> int:
    return fmt.code_bits


def _trellis(fmt: TCQ) -> tuple[int, int]:
    """(table_bits, shift_bits) of a TCQ format's codes, as its ops take them."""
    return tcq.tcq_kernel_table_bits(fmt.bits, fmt.code), tcq.tcq_shift_bits(fmt.bits)


def _codes_per_row(fmt: PaletteFormat, in_features: int) -> int:
    return in_features // (2 if isinstance(fmt, VQ) else 1)


def _codebook(fmt: PaletteFormat) -> Tensor:
    """fp32 [2^b, d]: what each code decodes to (before the row scale)."""
    values = fmt.code_values()
    return values if values.dim() == 2 else values[:, None]


class PalettePacked(Layout):
    name = "palette_packed"
    version = 1
    backends = ("cpu", "triton")

    def supports(self, fmt) -> bool:
        return isinstance(fmt, (NUQ, VQ, TCQ, HalfTCQ))

    def _check(self, fmt):
        if not self.supports(fmt):
            raise ValueError(f"layout {self.name} holds nuq/vq/tcq formats only, not {fmt.name}")

    @staticmethod
    def _tcq_parts(fmt) -> dict[str, TCQ]:
        """code buffer name -> the TCQ format those codes are in."""
        if isinstance(fmt, HalfTCQ):
            lo, hi = fmt.halves()
            return {"codes_lo": lo, "codes_hi": hi}
        return {"codes": fmt}

    def pack(self, fmt: PaletteFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        self._check(fmt)
        out = {k: q[k].contiguous() for k in ("row_scales", "signs") if k in q}
        if isinstance(fmt, (TCQ, HalfTCQ)):
            out.update({k: q[k].contiguous() for k in self._tcq_parts(fmt)})
        else:
            out["codes"] = pack_streams(q["codes"], _code_bits(fmt))
        return out

    def unpack(self, fmt: PaletteFormat, buffers: dict[str, Tensor], out_features: int, in_features: int) -> dict[str, Tensor]:
        self._check(fmt)
        q = {k: v for k, v in buffers.items() if k in ("row_scales", "signs")}
        if isinstance(fmt, (TCQ, HalfTCQ)):
            q.update({k: buffers[k] for k in self._tcq_parts(fmt)})
        else:
            dtype = fmt.code_shapes(1, 2)["codes"][1]
            codes = unpack_streams(buffers["codes"], _code_bits(fmt), _codes_per_row(fmt, in_features))
            q["codes"] = codes.to(dtype)
        return q

    def buffer_shapes(self, fmt: PaletteFormat, out_features: int, in_features: int):
        self._check(fmt)
        shapes = fmt.buffer_shapes(out_features, in_features)
        if not isinstance(fmt, (TCQ, HalfTCQ)):
            words = stream_words(_codes_per_row(fmt, in_features), _code_bits(fmt))
            shapes["codes"] = ((out_features, words), torch.int32)
        return shapes

    def runtime_buffers(self, fmt: PaletteFormat) -> dict[str, Tensor]:
        self._check(fmt)
        if isinstance(fmt, (TCQ, HalfTCQ)):
            return {f"table{k[5:]}": tcq.tcq_kernel_table(part.bits, part.code)
                    for k, part in self._tcq_parts(fmt).items()}
        return {"table": _codebook(fmt).contiguous()}

    def linear(self, fmt: PaletteFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        if backend == "triton":
            xr = self._rotate_for_triton(fmt, buffers, x)
        else:  # the C++ kernels, fp32 end to end (no second rounding of bf16 inputs)
            xr = fmt.rotate_activations(x.float(), buffers.get("signs"))
        return self.fused_op(fmt, buffers, xr, bias, backend).to(x.dtype)

    @staticmethod
    def _rotate_for_triton(fmt: PaletteFormat, buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        # x' in x's dtype (the Hadamard kernel computes in fp32 and rounds once), so fp16/bf16 feed the
        # tensor cores. CPU tensors (the interpreter) call the Triton Hadamard kernel directly, as the
        # matmul's wrapper does the matmul kernel; the interpreter stores bf16 by truncation, so there
        # bf16 rotates in fp32.
        if x.device.type != "cpu":
            return fmt.rotate_activations(x, buffers.get("signs"))  # CUDA: the op's Triton impl
        xr = x.float() if x.dtype == torch.bfloat16 else x
        if not fmt.rotate:
            return xr
        return hadamard_transform(xr, buffers["signs"].float(), backend="triton")

    def kernel_ops(self, fmt) -> tuple:
        return super().kernel_ops(fmt) + ((_fused_op(fmt), "palette"),)

    def fused_op(self, fmt: PaletteFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
                 backend: Backend) -> Tensor:
        """codebook_linear (nuq, vq), tcq_linear, or tcq_half_linear (both halves of K in one launch)."""
        if isinstance(fmt, HalfTCQ):
            lo, hi = fmt.halves()
            (table_bits_lo, shift_bits_lo), (table_bits_hi, shift_bits_hi) = _trellis(lo), _trellis(hi)
            return tcq_half_linear(x, buffers["codes_lo"], buffers["table_lo"], table_bits_lo, shift_bits_lo,
                                   buffers["codes_hi"], buffers["table_hi"], table_bits_hi, shift_bits_hi,
                                   buffers["row_scales"], bias, backend=backend)
        if isinstance(fmt, TCQ):
            table_bits, shift_bits = _trellis(fmt)
            return tcq_linear(x, buffers["codes"], buffers["table"], table_bits, shift_bits, buffers["row_scales"],
                              bias, backend=backend)
        return codebook_linear(x, buffers["codes"], _code_bits(fmt), buffers["table"], buffers["row_scales"], bias,
                               backend=backend)

    def kernel_call(self, fmt: PaletteFormat, buffers: dict[str, Tensor]) -> tuple[str, list]:
        """(op, weight args between x' and row_scales) of fused_op."""
        op, _, args = self.op_call(fmt, buffers, None, None)
        return op, list(args[1:-2])


def _decode_codebook(codes, code_bits, table, row_scales, in_features):
    """The reference decode of nuq/vq codes in this layout's streams (codebook ops' CPU references without
    the extension): fp32 W' [N, K]."""
    per_row = in_features // table.shape[1]
    return scale_rows(codebook_decode(unpack_streams(codes, code_bits, per_row), table), row_scales)


def _decode_tcq(in_features, codes, table, table_bits, shift_bits, row_scales):
    """The reference decode of TCQ codes from the kernels' table (tcq ops' CPU references without the
    extension): fp32 W' [N, K]."""
    values = tcq.tcq_kernel_state_values(table, table_bits)
    return scale_rows(tcq_decode_tiles(codes, values, shift_bits / 2), row_scales)


register_reference_cpu_impls(_decode_codebook, _decode_tcq)
PALETTE_PACKED = register_layout(PalettePacked(), default_for="palette", device="cpu")
# On CUDA too (the Triton kernels): nuq's CPU default is nuq_i8_n16, palette_dense stays the portable one.
register_layout(PALETTE_PACKED, default_for="palette", device="cuda")
register_layout(PALETTE_PACKED, default_for="nuq", device="cuda")
