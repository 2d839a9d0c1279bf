"""stream_rowmajor: the off-CPU layout of the 1-, 2-, 3- and 8-bit scalar-codebook formats (int1_g*,
int2_g*, int2_sym_g*, int3_g*, q8_0); on the CPU they default to the int8-activation tiles lut{b}_i8_n16.
(8-bit streams are the code bytes in order, each int32 word holding 4 codes, the first in its top byte.)

codes: int32 [N, ceil(K b / 32)], one MSB-first b-bit stream per row (torch_lowbit.core.packing.pack_stream,
the packing gcb_rowmajor uses too); scales / mins: fp16 [N, K / group]. The op
torch_lowbit::lowbit_linear reads it: Triton on CUDA (triton_kernels/lowbit.py), the family's
reference dequantizer + a dense matmul on CPU tensors (a portable fallback, not a CPU kernel).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..formats.scalar import ScalarCodebookFormat, dequantize_groups
from ..core.packing import STREAM_CODE_BITS, pack_stream, unpack_stream
from ..ops import Backend
from ..ops.lowbit import lowbit_linear, register_reference_cpu_impls
from .base import register_layout
from .scalar_rowmajor import ScalarRowMajor


class StreamRowMajor(ScalarRowMajor):
    name = "stream_rowmajor"
    version = 1
    isa_paths = False  # its CPU impl is plain torch: one path
    codes_key, op, kernels = "codes", "lowbit_linear", "lowbit"

    def supports(self, fmt) -> bool:
        return (isinstance(fmt, ScalarCodebookFormat) and fmt.code_bits in STREAM_CODE_BITS
                and fmt.group_size % 32 == 0)

    def pack_codes(self, fmt: ScalarCodebookFormat, codes: Tensor) -> Tensor:
        return pack_stream(codes, fmt.code_bits)

    def unpack_codes(self, fmt: ScalarCodebookFormat, packed: Tensor, in_features: int) -> Tensor:
        return unpack_stream(packed, fmt.code_bits, in_features).to(torch.uint8)

    def codes_shape(self, fmt: ScalarCodebookFormat, out_features: int, in_features: int) -> tuple:
        return (out_features, -(-in_features * fmt.code_bits // 32)), torch.int32

    def fused_op(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
                 backend: Backend) -> Tensor:
        return lowbit_linear(x, buffers["codes"], fmt.code_bits, buffers["scales"], buffers.get("mins"),
                             buffers["lut"], fmt.group_size, bias, backend=backend)


def _decode(in_features, codes, code_bits, scales, mins, lut, group_size):
    """The reference decode of this layout's buffers (the lowbit ops' CPU impls)."""
    return dequantize_groups(lut, unpack_stream(codes, code_bits, in_features), scales, mins, group_size)


register_reference_cpu_impls(_decode)
STREAM_ROWMAJOR = StreamRowMajor()
for _bits in STREAM_CODE_BITS:
    register_layout(STREAM_ROWMAJOR, default_for=f"lut{_bits}")
