"""lowbit_rowmajor: the off-CPU layout of the 1-, 2- and 3-bit scalar-codebook formats (int1_g*,
int2_g*, int2_sym_g*, int3_g*); on the CPU they default to the int8-activation tiles lut{b}_i8_n16.

codes: int32 [N, ceil(K b / 32)], one MSB-first b-bit stream per row (palette_packed.pack_stream,
the packing gcb_rowmajor uses too); scales / mins: fp16 [N, K / group]. The op
torch_lowbit::lowbit_linear reads it: Triton on CUDA (triton_kernels/lowbit.py), the family's
reference dequantizer + a dense matmul on CPU tensors (a portable fallback, not a CPU kernel).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..formats.scalar import ScalarCodebookFormat
from .base import Layout, register_layout, run_op
from .palette_packed import pack_stream, unpack_stream

BITS = (1, 2, 3)


class LowbitRowMajor(Layout):
    name = "lowbit_rowmajor"
    version = 1
    isa_paths = False  # its CPU impl is plain torch: one path

    def supports(self, fmt) -> bool:
        return isinstance(fmt, ScalarCodebookFormat) and fmt.code_bits in BITS and fmt.group_size % 32 == 0

    def pack(self, fmt: ScalarCodebookFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {"codes": pack_stream(q["codes"], fmt.code_bits), "scales": q["scales"].contiguous()}
        if fmt.has_mins:
            out["mins"] = q["mins"].contiguous()
        return out

    def unpack(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], out_features: int,
               in_features: int) -> dict[str, Tensor]:
        q = {"codes": unpack_stream(buffers["codes"], fmt.code_bits, in_features).to(torch.uint8),
             "scales": buffers["scales"]}
        if fmt.has_mins:
            q["mins"] = buffers["mins"]
        return q

    def buffer_shapes(self, fmt: ScalarCodebookFormat, out_features: int, in_features: int):
        groups = in_features // fmt.group_size
        shapes = {"codes": ((out_features, -(-in_features * fmt.code_bits // 32)), torch.int32),
                  "scales": ((out_features, groups), torch.float16)}
        if fmt.has_mins:
            shapes["mins"] = ((out_features, groups), torch.float16)
        return shapes

    def runtime_buffers(self, fmt: ScalarCodebookFormat) -> dict[str, Tensor]:
        return {"lut": fmt.code_values().float().contiguous()}

    def linear(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor,
               bias: Optional[Tensor], backend: str, out_features: int) -> Tensor:
        args = (x, buffers["codes"], fmt.code_bits, buffers["scales"], buffers.get("mins"), buffers["lut"],
                fmt.group_size, bias)
        return run_op("lowbit_linear", "lowbit", args, backend, x)


LOWBIT_ROWMAJOR = register_layout(LowbitRowMajor(), default_for="lut1")
for _bits in BITS[1:]:
    register_layout(LOWBIT_ROWMAJOR, default_for=f"lut{_bits}")
