"""palette_dense: the portable layout of the Q-Palette formats (nuq*, vq*, tcq*).

Buffers are the format's own tensors as quantize() returns them (codes, row_scales, signs). The
forward rotates the activations (x' = (x * s) @ H), decodes W' with the format's reference decoder
and runs a dense matmul: correct on any device and under torch.compile, but it decodes the whole
weight on every call. The fused CPU kernels read their own layouts.
"""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from ..formats.palette import PaletteFormat
from .base import Layout, register_layout


class PaletteDense(Layout):
    name = "palette_dense"
    version = 1
    backends = ("cpu",)  # plain torch ops: the same code on every device, no ISA paths
    isa_paths = False

    def supports(self, fmt) -> bool:
        return isinstance(fmt, PaletteFormat)

    def pack(self, fmt: PaletteFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        return {k: v.contiguous() for k, v in q.items()}

    def unpack(self, fmt: PaletteFormat, buffers: dict[str, Tensor], out_features: int, in_features: int) -> dict[str, Tensor]:
        return dict(buffers)

    def buffer_shapes(self, fmt: PaletteFormat, out_features: int, in_features: int):
        return fmt.buffer_shapes(out_features, in_features)

    def runtime_buffers(self, fmt: PaletteFormat) -> dict[str, Tensor]:
        return fmt.decode_tables()

    def linear(self, fmt: PaletteFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        # fp32 throughout (the rotation would otherwise round bf16/fp16 inputs a second time)
        xr = fmt.rotate_activations(x.float(), buffers.get("signs"))
        y = F.linear(xr, fmt.dequantize_rotated(buffers), bias.float() if bias is not None else None)
        return y.to(x.dtype)


PALETTE_DENSE = register_layout(PaletteDense(), default_for="palette")
register_layout(PALETTE_DENSE, default_for="nuq")  # off the CPU (nuq_i8_n16 is the CPU default)
