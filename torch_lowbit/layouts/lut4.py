"""lut4_rowmajor: the layout of every 4-bit scalar-codebook format (q4_0, int4_g*).

qweight [N, K/2] uint8, 32 codes per 16 bytes: byte j of a 32-code run holds code j in its low
nibble and code j+16 in its high nibble (ggml's Q4_0 block order: a GGUF Q4_0 block's qs bytes are
these bytes as they are). scales/mins [N, K/group] fp16. The kernels (csrc/common/lut4.h,
triton_kernels/lut4.py) read this and a 16-entry fp32 table of code values taken from the format.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..formats.scalar import ScalarCodebookFormat
from .base import Layout, register_layout, run_op


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes [N, K] (K % 32 == 0, values < 16) -> [N, K/2] bytes in 32-code half-split order."""
    n, k = codes.shape
    c = codes.reshape(n, k // 32, 2, 16)
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(packed: Tensor) -> Tensor:
    n, half = packed.shape
    b = packed.reshape(n, half // 16, 16)
    return torch.stack((b & 0x0F, b >> 4), dim=2).reshape(n, half * 2)


class Lut4RowMajor(Layout):
    name = "lut4_rowmajor"
    version = 1

    def supports(self, fmt) -> bool:
        return isinstance(fmt, ScalarCodebookFormat) and fmt.code_bits == 4 and fmt.group_size % 32 == 0

    def pack(self, fmt: ScalarCodebookFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {"qweight": pack_nibbles(q["codes"]), "scales": q["scales"].contiguous()}
        if fmt.has_mins:
            out["mins"] = q["mins"].contiguous()
        return out

    def unpack(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], out_features: int, in_features: int) -> dict[str, Tensor]:
        q = {"codes": unpack_nibbles(buffers["qweight"]), "scales": buffers["scales"]}
        if fmt.has_mins:
            q["mins"] = buffers["mins"]
        return q

    def buffer_shapes(self, fmt: ScalarCodebookFormat, out_features: int, in_features: int):
        groups = in_features // fmt.group_size
        shapes = {"qweight": ((out_features, in_features // 2), torch.uint8),
                  "scales": ((out_features, groups), torch.float16)}
        if fmt.has_mins:
            shapes["mins"] = ((out_features, groups), torch.float16)
        return shapes

    def runtime_buffers(self, fmt: ScalarCodebookFormat) -> dict[str, Tensor]:
        return {"lut": fmt.code_values().float().contiguous()}

    def linear(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor,
               bias: Optional[Tensor], backend: str, out_features: int) -> Tensor:
        args = (x, buffers["qweight"], buffers["scales"], buffers.get("mins"), buffers["lut"],
                fmt.group_size, bias)
        return run_op("lut4_linear", "lut4", args, backend, x)


LUT4_ROWMAJOR = register_layout(Lut4RowMajor(), default_for="lut4")
