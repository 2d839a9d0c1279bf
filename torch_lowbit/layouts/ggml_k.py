"""ggml_k_blocks: the K-quant formats (q2_k .. q6_k) stored as their GGUF block bytes.

blocks: uint8 [N, K/256 * block bytes], each row its super-blocks exactly as a GGUF file stores them
(core/kquant_blocks.py): the file's bytes as they are, for checkpoints that must hold them. Its
forward is the reference path on any device: it decodes the bytes in torch, dequantizes with the
format's reference dequantizer and multiplies in fp32 (F.linear), a full fp32 weight per call. The
defaults are kquant_i8_n16 on the CPU and kquant_stream elsewhere (their kernels read the same fields).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.kquant_blocks import BLOCK_BYTES, SUPER_BLOCK, blocks_to_tensors, tensors_to_blocks
from ..formats.kquants import KQuantFormat
from ..ops._common import dense_linear
from .base import Layout, register_layout


class GgmlKBlocks(Layout):
    name = "ggml_k_blocks"
    version = 1
    backends = ("cpu", "triton")  # plain torch: runs wherever the tensors are
    isa_paths = False

    def supports(self, fmt) -> bool:
        return isinstance(fmt, KQuantFormat)

    def pack(self, fmt: KQuantFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"blocks": tensors_to_blocks(fmt.name, q)}

    def unpack(self, fmt: KQuantFormat, buffers: dict[str, Tensor], out_features: int,
               in_features: int) -> dict[str, Tensor]:
        return blocks_to_tensors(fmt.name, buffers["blocks"])

    def gather_rows(self, fmt: KQuantFormat, buffers: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        return blocks_to_tensors(fmt.name, buffers["blocks"][rows])

    def buffer_shapes(self, fmt: KQuantFormat, out_features: int, in_features: int):
        return {"blocks": ((out_features, in_features // SUPER_BLOCK * BLOCK_BYTES[fmt.name]), torch.uint8)}

    def linear(self, fmt: KQuantFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        # fp32 weight and matmul whatever x's dtype, as the fused kernels accumulate
        return dense_linear(x, fmt.dequantize(blocks_to_tensors(fmt.name, buffers["blocks"])), bias)


GGML_K_BLOCKS = register_layout(GgmlKBlocks())
