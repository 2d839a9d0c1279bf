"""gcb_rowmajor: the portable layout of the group-codebook formats (gcb2, gcb3).

Buffers: codes as one MSB-first b-bit stream per row (int32 words), one byte per 32-weight
sub-group holding (codebook index << 4) | sub-scale, the fp16 superblock scales, and the layer's
int8 codebook table (64-128 bytes, saved so a checkpoint never depends on a codebook file). The
forward decodes with the format's reference dequantizer and runs a dense matmul: correct on any
device and under torch.compile; the register-codebook int8 kernels are the next step (issue #6).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..formats.gcb import SUBGROUP, GroupCodebook
from .base import Layout, register_layout
from .palette_packed import pack_stream, unpack_stream


class GcbRowMajor(Layout):
    name = "gcb_rowmajor"
    version = 1
    backends = ("cpu",)  # plain torch ops: the same code on every device
    isa_paths = False

    def supports(self, fmt) -> bool:
        return isinstance(fmt, GroupCodebook)

    def pack(self, fmt: GroupCodebook, q: dict[str, Tensor]) -> dict[str, Tensor]:
        sub = (q["codebook_index"].to(torch.int32) << 4) | q["sub_scales"].to(torch.int32)
        return {"codes": pack_stream(q["codes"], fmt.bits), "sub_groups": sub.to(torch.uint8).contiguous(),
                "super_scales": q["super_scales"].contiguous(), "codebooks": q["codebooks"].contiguous()}

    def unpack(self, fmt: GroupCodebook, buffers: dict[str, Tensor], out_features: int,
               in_features: int) -> dict[str, Tensor]:
        sub = buffers["sub_groups"].to(torch.int32)
        return {"codes": unpack_stream(buffers["codes"], fmt.bits, in_features).to(torch.uint8),
                "codebook_index": (sub >> 4).to(torch.uint8), "sub_scales": (sub & 15).to(torch.uint8),
                "super_scales": buffers["super_scales"], "codebooks": buffers["codebooks"]}

    def buffer_shapes(self, fmt: GroupCodebook, out_features: int, in_features: int):
        return {"codes": ((out_features, -(-in_features * fmt.bits // 32)), torch.int32),
                "sub_groups": ((out_features, in_features // SUBGROUP), torch.uint8),
                "super_scales": ((out_features, in_features // fmt.superblock), torch.float16),
                "codebooks": (tuple(fmt.table().shape), torch.int8)}

    def linear(self, fmt: GroupCodebook, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        w = fmt.dequantize(self.unpack(fmt, buffers, out_features, x.shape[-1]))
        return F.linear(x.float(), w, bias.float() if bias is not None else None).to(x.dtype)


GCB_ROWMAJOR = register_layout(GcbRowMajor(), default_for="gcb")
