"""gvq_rowmajor: the layout of the general VQ formats (gvq*, aqlm_*, gptvq2).

Codes: a row's codes in order (vector j, stage r) are its fields, LSB-first bit fields of code_bits
bits (core.packing.pack_bitfields: 8-bit codes are plain bytes, 16-bit ones little-endian uint16).
The fields are cut into chunks of chunk_fields(2^y) (a multiple of 8: whole bytes) and stored
chunk-major, every row's bytes of chunk 0, then of chunk 1, ...: the CPU kernel streams one chunk of
all rows against that chunk's L1-resident tables (csrc/common/gvq.h). The buffer is [N, row bytes],
exactly the row-major size. Codebooks are stored as planes [regions, stages, vec, 2^y] (coordinate d
of every entry contiguous, what the kernels convert 16 entries at a time), their entries **reordered
by use** at packing (entry 0 the most used in its region and stage, the codes renumbered to match), so
a kernel can keep the hottest entries of each table as its first ones; the dequantized weight is the
same bit for bit. row_scales fp16 [N] and the rotation's signs as the format stores them.

The forward rotates the activations (rotated formats) and calls gvq_linear.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.packing import bitfield_bytes, pack_bitfields, unpack_bitfields

LUT_BYTES = 16384  # fp32 tables of one chunk per token (csrc/common/gvq.h gvq_chunk_fields)


def chunk_fields(entries: int) -> int:
    """Fields per chunk for codebooks of `entries` entries: 8 .. 64, a multiple of 8."""
    return min(64, max(8, (LUT_BYTES // 4 // entries) // 8 * 8))


def chunk_major(codes: Tensor, bits: int, entries: int) -> Tensor:
    """Codes [N, F] -> uint8 [N, bitfield_bytes(F, bits)] holding chunk-major bit fields (module doc)."""
    n, f = codes.shape
    cf = chunk_fields(entries)
    full = f // cf
    parts = []
    if full:
        blocks = codes[:, :full * cf].reshape(n, full, cf).permute(1, 0, 2).reshape(full * n, cf)
        parts.append(pack_bitfields(blocks, bits).reshape(-1))
    if f % cf:
        parts.append(pack_bitfields(codes[:, full * cf:], bits).reshape(-1))
    return torch.cat(parts).reshape(n, bitfield_bytes(f, bits))


def from_chunk_major(packed: Tensor, bits: int, entries: int, fields: int) -> Tensor:
    """Inverse of chunk_major: int64 codes [N, fields]."""
    n = packed.shape[0]
    cf = chunk_fields(entries)
    full = fields // cf
    flat = packed.reshape(-1)
    whole = full * n * (cf * bits // 8)
    parts = []
    if full:
        blocks = unpack_bitfields(flat[:whole].reshape(full * n, cf * bits // 8), bits, cf)
        parts.append(blocks.reshape(full, n, cf).permute(1, 0, 2).reshape(n, full * cf))
    if fields % cf:
        parts.append(unpack_bitfields(flat[whole:].reshape(n, -1), bits, fields % cf))
    return torch.cat(parts, 1)
from ..formats.gvq import GeneralVQ, decode_vectors, region_index
from ..ops import Backend
from ..ops.gvq import gvq_linear, register_reference_impls
from .base import Layout, register_layout


class GvqRowMajor(Layout):
    name = "gvq_rowmajor"
    version = 1
    backends = ("cpu",)  # C++ table kernels per ISA path; on CUDA the ops' dense reference (no Triton kernel yet)

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
        out = {"codes": chunk_major(codes.reshape(n, nv * z), fmt.entries_log2, fmt.entries),
               "codebooks": books.transpose(2, 3).contiguous(), "row_scales": q["row_scales"].contiguous()}
        if fmt.rotate:
            out["signs"] = q["signs"].contiguous()
        return out

    def unpack(self, fmt: GeneralVQ, buffers: dict[str, Tensor], out_features: int, in_features: int) -> dict[str, Tensor]:
        self._check(fmt)
        nv = in_features // fmt.vec
        codes = from_chunk_major(buffers["codes"], fmt.entries_log2, fmt.entries, nv * fmt.residuals)
        q = {"codes": codes.reshape(out_features, nv, fmt.residuals).to(torch.int32),
             "codebooks": buffers["codebooks"].transpose(2, 3).contiguous(), "row_scales": buffers["row_scales"]}
        if fmt.rotate:
            q["signs"] = buffers["signs"]
        return q

    def buffer_shapes(self, fmt: GeneralVQ, out_features: int, in_features: int):
        self._check(fmt)
        shapes = fmt.tensor_shapes(out_features, in_features)
        count = in_features // fmt.vec * fmt.residuals
        shapes["codes"] = ((out_features, bitfield_bytes(count, fmt.entries_log2)), torch.uint8)
        regions, stages, entries, vec = shapes["codebooks"][0]
        shapes["codebooks"] = ((regions, stages, vec, entries), torch.float16)
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


def _decode(codes, code_bits, planes, tile_rows, tile_cols, row_scales, in_features):
    """The reference decode of gvq_rowmajor buffers: fp32 W' [N, K]."""
    n, (_, stages, vec, entries) = row_scales.shape[0], planes.shape
    nv = in_features // vec
    unpacked = from_chunk_major(codes, code_bits, entries, nv * stages).reshape(n, nv, stages)
    return decode_vectors(unpacked, planes.transpose(2, 3), tile_rows, tile_cols) * row_scales.float()[:, None]


register_reference_impls(_decode)
GVQ_ROWMAJOR = register_layout(GvqRowMajor(), default_for="gvq")
