"""gvq_rowmajor: the layout of the general VQ formats (gvq*, aqlm_*, gptvq2).

Codes: each row's codes in order (vector j, stage r) as little-endian bit fields of code_bits bits
(core.packing.pack_bitfields: 8-bit codes are plain bytes, 16-bit ones little-endian uint16).
Codebooks fp16 [regions, stages, 2^y, vec], their entries **reordered by access frequency** at
packing (entry 0 the most used in its region and stage; the codes renumbered to match), so a kernel's
codebook cache holds the hottest entries as the first n of each table; the dequantized weight is the
same bit for bit. row_scales fp16 [N] and the rotation's signs as the format stores them.

The forward rotates the activations (rotated formats) and calls gvq_linear.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.packing import bitfield_bytes, pack_bitfields, unpack_bitfields
from ..formats.gvq import GeneralVQ, decode_vectors, region_index
from ..ops import Backend
from ..ops.gvq import gvq_linear, register_reference_impls
from .base import Layout, register_layout


class GvqRowMajor(Layout):
    name = "gvq_rowmajor"
    version = 1
    backends = ("cpu",)  # the ops' dense reference (CPU and CUDA); no fused kernel yet
    isa_paths = False

    def supports(self, fmt) -> bool:
        return isinstance(fmt, GeneralVQ)

    def _check(self, fmt):
        if not self.supports(fmt):
            raise ValueError(f"layout {self.name} holds the gvq formats only, not {fmt.name}")

    def pack(self, fmt: GeneralVQ, q: dict[str, Tensor]) -> dict[str, Tensor]:
        self._check(fmt)
        codes, books = q["codes"], q["codebooks"]
        n, nv, z = codes.shape
        region = region_index(*fmt.scope, n, nv * fmt.vec, torch.arange(n, device=codes.device),
                              torch.arange(nv, device=codes.device) * fmt.vec)
        codes, books = reorder_by_frequency_in(codes, books, region)
        out = {"codes": pack_bitfields(codes.reshape(n, nv * z), fmt.entries_log2),
               "codebooks": books.contiguous(), "row_scales": q["row_scales"].contiguous()}
        if fmt.rotate:
            out["signs"] = q["signs"].contiguous()
        return out

    def unpack(self, fmt: GeneralVQ, buffers: dict[str, Tensor], out_features: int, in_features: int) -> dict[str, Tensor]:
        self._check(fmt)
        nv = in_features // fmt.vec
        codes = unpack_bitfields(buffers["codes"], fmt.entries_log2, nv * fmt.residuals)
        q = {"codes": codes.reshape(out_features, nv, fmt.residuals).to(torch.int32),
             "codebooks": buffers["codebooks"], "row_scales": buffers["row_scales"]}
        if fmt.rotate:
            q["signs"] = buffers["signs"]
        return q

    def buffer_shapes(self, fmt: GeneralVQ, out_features: int, in_features: int):
        self._check(fmt)
        shapes = fmt.tensor_shapes(out_features, in_features)
        count = in_features // fmt.vec * fmt.residuals
        shapes["codes"] = ((out_features, bitfield_bytes(count, fmt.entries_log2)), torch.uint8)
        return shapes

    def kernel_ops(self, fmt) -> tuple:
        return super().kernel_ops(fmt) + (("gvq_linear", None),)

    def fused_op(self, fmt: GeneralVQ, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
                 backend: Backend) -> Tensor:
        return gvq_linear(x, buffers["codes"], fmt.entries_log2, buffers["codebooks"], *fmt.scope,
                          buffers["row_scales"], bias, backend=backend)

    def linear(self, fmt: GeneralVQ, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        xr = fmt.rotate_activations(x.float(), buffers.get("signs"))  # fp32: no second rounding of bf16
        return self.fused_op(fmt, buffers, xr, bias, "auto").to(x.dtype)


def reorder_by_frequency_in(codes: Tensor, codebooks: Tensor, region: Tensor) -> tuple[Tensor, Tensor]:
    """(codes, codebooks) with every region's stage tables sorted by how often their entries are used
    (most used first, ties by entry index) and codes [N, nv, z] renumbered to match (region [N, nv]:
    each vector's region); decode_vectors gives the same weight bit for bit."""
    regions, stages, entries, vec = codebooks.shape
    new_codes, new_books = torch.empty_like(codes), torch.empty_like(codebooks)
    for r in range(stages):
        key = region * entries + codes[..., r].long()
        counts = torch.bincount(key.reshape(-1), minlength=regions * entries).reshape(regions, entries)
        order = torch.sort(-counts, dim=1, stable=True).indices  # [regions, entries]: new index -> old
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(entries, device=order.device).expand_as(order))
        new_books[:, r] = codebooks[:, r].gather(1, order[..., None].expand(-1, -1, vec))
        new_codes[..., r] = rank.reshape(-1)[key].to(codes.dtype)
    return new_codes, new_books


def _decode(codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, in_features):
    """The reference decode of gvq_rowmajor buffers: fp32 W' [N, K]."""
    n, (_, stages, _, vec) = row_scales.shape[0], codebooks.shape
    nv = in_features // vec
    unpacked = unpack_bitfields(codes, code_bits, nv * stages).reshape(n, nv, stages)
    return decode_vectors(unpacked, codebooks, tile_rows, tile_cols) * row_scales.float()[:, None]


register_reference_impls(_decode)
GVQ_ROWMAJOR = register_layout(GvqRowMajor(), default_for="gvq")
