"""lut4_rowmajor: the layout of every 4-bit scalar-codebook format (q4_0, int4_g*).

qweight [N, K/2] uint8, 32 codes per 16 bytes: byte j of a 32-code run holds code j in its low
nibble and code j+16 in its high nibble (ggml's Q4_0 block order: a GGUF Q4_0 block's qs bytes are
these bytes as they are). scales/mins [N, K/group] fp16. The kernels (csrc/common/lut4.h,
triton_kernels/lut4.py) read this and a 16-entry fp32 table of code values taken from the format.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..formats.scalar import ScalarCodebookFormat
from ..packing import pack_nibbles, unpack_nibbles
from .base import register_layout
from .scalar_rowmajor import ScalarRowMajor


class Lut4RowMajor(ScalarRowMajor):
    name = "lut4_rowmajor"
    version = 1
    codes_key, op, kernels = "qweight", "lut4_linear", "lut4"

    def supports(self, fmt) -> bool:
        return isinstance(fmt, ScalarCodebookFormat) and fmt.code_bits == 4 and fmt.group_size % 32 == 0

    def pack_codes(self, fmt: ScalarCodebookFormat, codes: Tensor) -> Tensor:
        return pack_nibbles(codes)

    def unpack_codes(self, fmt: ScalarCodebookFormat, packed: Tensor, in_features: int) -> Tensor:
        return unpack_nibbles(packed)

    def codes_shape(self, fmt: ScalarCodebookFormat, out_features: int, in_features: int) -> tuple:
        return (out_features, in_features // 2), torch.uint8


LUT4_ROWMAJOR = register_layout(Lut4RowMajor(), default_for="lut4")
