"""kquant_stream: the K-quant formats (q2_k .. q6_k) off the CPU (CUDA default), read by the Triton
kernels of the op torch_lowbit::kquant_linear (triton_kernels/kquant.py).

codes: int32 [N, K b / 32], one MSB-first b-bit stream per row (core.packing.pack_stream, as
stream_rowmajor); sub_scales: int8 [N, K / sub-block] (q2_k / q4_k / q5_k's unsigned 0..63 fit);
sub_mins: uint8 (the affine types); d / dmin: fp16 [N, K / 256]. Every field of the GGUF block is
kept as it is, so unpack gives back the format's tensors and to_gguf the file's bytes; at 4 bits a
row takes the GGUF block's bytes (q4_k: 4.5 bits a weight), the scales unpacked to a byte each
(+0.25-0.5 bit a weight over the file; q6_k and q3_k's 8-bit and 6-bit scales are a byte already).
On CPU tensors the op runs the format's reference decoder and a dense matmul (portable, not a kernel:
the CPU default is kquant_i8_n16).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.kquant_blocks import STRUCTURES, SUPER_BLOCK
from ..core.packing import pack_stream, unpack_stream
from ..formats import get_format
from ..formats.kquants import KQuantFormat
from ..ops import Backend
from ..ops.kquant import kquant_linear, register_reference_cpu_impls
from .base import Layout, register_layout


class KQuantStream(Layout):
    name = "kquant_stream"
    version = 1
    isa_paths = False  # its CPU impl is plain torch: one path

    def supports(self, fmt) -> bool:
        return isinstance(fmt, KQuantFormat)

    def pack(self, fmt: KQuantFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {"codes": pack_stream(q["codes"], fmt.code_bits),
               "sub_scales": q["sub_scales"].view(torch.int8).contiguous(), "d": q["d"].contiguous()}
        if fmt.has_mins:
            out.update(sub_mins=q["sub_mins"].contiguous(), dmin=q["dmin"].contiguous())
        return out

    def unpack(self, fmt: KQuantFormat, buffers: dict[str, Tensor], out_features: int,
               in_features: int) -> dict[str, Tensor]:
        return _tensors(fmt, buffers, in_features)

    def gather_rows(self, fmt: KQuantFormat, buffers: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        in_features = buffers["d"].shape[1] * SUPER_BLOCK
        return _tensors(fmt, {key: t[rows] for key, t in buffers.items()}, in_features)

    def buffer_shapes(self, fmt: KQuantFormat, out_features: int, in_features: int):
        subs, supers = (out_features, in_features // fmt.sub_block), (out_features, in_features // SUPER_BLOCK)
        shapes = {"codes": ((out_features, in_features * fmt.code_bits // 32), torch.int32),
                  "sub_scales": (subs, torch.int8), "d": (supers, torch.float16)}
        if fmt.has_mins:
            shapes.update(sub_mins=(subs, torch.uint8), dmin=(supers, torch.float16))
        return shapes

    def kernel_ops(self, fmt) -> tuple:
        return (("kquant_linear", "kquant"),)

    def fused_op(self, fmt: KQuantFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
                 backend: Backend) -> Tensor:
        return kquant_linear(x, buffers["codes"], fmt.code_bits, buffers["sub_scales"], buffers.get("sub_mins"),
                             buffers["d"], buffers.get("dmin"), fmt.sub_block, fmt.code_offset, bias, backend=backend)

    def linear(self, fmt: KQuantFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        return self.fused_op(fmt, buffers, x, bias, backend)


def _tensors(fmt: KQuantFormat, buffers: dict[str, Tensor], in_features: int) -> dict[str, Tensor]:
    q = {"codes": unpack_stream(buffers["codes"], fmt.code_bits, in_features).to(torch.uint8),
         "sub_scales": buffers["sub_scales"].view(fmt.scale_dtype), "d": buffers["d"]}
    if fmt.has_mins:
        q.update(sub_mins=buffers["sub_mins"], dmin=buffers["dmin"])
    return q


def _decode(in_features, codes, code_bits, sub_scales, sub_mins, d, dmin, sub_block, code_offset):
    """The reference decode of this layout's buffers (the kquant ops' CPU impls)."""
    fmt = get_format(STRUCTURES[code_bits][0])  # the op checked sub_block, code_offset and mins against it
    return fmt.dequantize(_tensors(fmt, {"codes": codes, "sub_scales": sub_scales, "sub_mins": sub_mins, "d": d,
                                         "dmin": dmin}, in_features))


register_reference_cpu_impls(_decode)
KQUANT_STREAM = register_layout(KQuantStream(), default_for="ggml_k")
