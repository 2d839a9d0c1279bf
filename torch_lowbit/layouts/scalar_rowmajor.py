"""The off-CPU layouts of the scalar-codebook group formats share everything but the code packing:
codes [N, ...] under one buffer name, fp16 group scales (and mins) [N, K / group], the format's fp32
table as a runtime buffer, and one fused op (lut4_linear, lowbit_linear). A subclass (lut4_rowmajor,
stream_rowmajor) says how its codes are packed and calls its op."""
from __future__ import annotations

from abc import abstractmethod
from typing import Optional

import torch
from torch import Tensor

from ..formats.scalar import ScalarCodebookFormat
from ..ops import Backend
from .base import Layout


class ScalarRowMajor(Layout):
    codes_key: str  # the packed codes' buffer name
    op: str  # torch_lowbit::<op> (fused_op's), and the same-named function in triton_kernels/<kernels>.py
    kernels: str

    def kernel_ops(self, fmt) -> tuple:
        return ((self.op, self.kernels),)

    @abstractmethod
    def pack_codes(self, fmt: ScalarCodebookFormat, codes: Tensor) -> Tensor:
        """uint8 codes [N, K] -> the packed codes buffer."""

    @abstractmethod
    def unpack_codes(self, fmt: ScalarCodebookFormat, packed: Tensor, in_features: int) -> Tensor:
        """Inverse of pack_codes: uint8 [N, K]."""

    @abstractmethod
    def codes_shape(self, fmt: ScalarCodebookFormat, out_features: int, in_features: int) -> tuple:
        """(shape, dtype) of the packed codes buffer."""

    @abstractmethod
    def fused_op(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
                 backend: Backend) -> Tensor:
        """The layout's op on x, its codes, scales, mins, table and group size (Layout.fused_op)."""

    def pack(self, fmt: ScalarCodebookFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {self.codes_key: self.pack_codes(fmt, q["codes"]), "scales": q["scales"].contiguous()}
        if fmt.has_mins:
            out["mins"] = q["mins"].contiguous()
        return out

    def unpack(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], out_features: int,
               in_features: int) -> dict[str, Tensor]:
        q = {"codes": self.unpack_codes(fmt, buffers[self.codes_key], in_features), "scales": buffers["scales"]}
        if fmt.has_mins:
            q["mins"] = buffers["mins"]
        return q

    def gather_rows(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        in_features = buffers["scales"].shape[1] * fmt.group_size
        q = {"codes": self.unpack_codes(fmt, buffers[self.codes_key][rows], in_features),
             "scales": buffers["scales"][rows]}
        if fmt.has_mins:
            q["mins"] = buffers["mins"][rows]
        return q

    def buffer_shapes(self, fmt: ScalarCodebookFormat, out_features: int, in_features: int):
        groups = in_features // fmt.group_size
        shapes = {self.codes_key: self.codes_shape(fmt, out_features, in_features),
                  "scales": ((out_features, groups), torch.float16)}
        if fmt.has_mins:
            shapes["mins"] = ((out_features, groups), torch.float16)
        return shapes

    def runtime_buffers(self, fmt: ScalarCodebookFormat) -> dict[str, Tensor]:
        return {"lut": fmt.code_values().float().contiguous()}

    def linear(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor,
               bias: Optional[Tensor], backend: str, out_features: int) -> Tensor:
        return self.fused_op(fmt, buffers, x, bias, backend)
