"""Layouts of the group-codebook formats (gcb2, gcb3). Both store one byte per 32-weight sub-group,
(codebook index << 4) | sub-scale, the fp16 superblock scales and the layer's int8 codebook table
(64-128 bytes, saved so a checkpoint never depends on a codebook file).

gcb_i8_n16 (CPU default): the codes in the 16-row tiles of lut{b}_i8_n16 (layouts/lut_i8.py), the
sub-group bytes as [N/16, K/32, 16] and the superblock scales as [N/16, K/superblock, 16], run by
the int8-activation kernels of lut_i8_linear (csrc/common/lut_i8.h): the 16 codebooks sit in one
(gcb2) or two (gcb3) vector registers and vpermb / vpermi2b look each row's codes up in its block's
codebook (AVX-512 VBMI; AVX2: a gather of each row's codebook + vpshufb; portable scalar).

gcb_rowmajor (default off the CPU): codes as one MSB-first b-bit stream per row (int32 words),
sub-group bytes uint8 [N, K/32], superblock scales fp16 [N, K/superblock], the codebooks. The op
torch_lowbit::gcb_linear reads it: Triton on CUDA (triton_kernels/lowbit.py), the format's reference
dequantizer + a dense matmul on CPU tensors (portable fallback).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.activations import fake_quantize_q8_blocks
from ..formats.gcb import GroupCodebook, dequantize_subgroups
from ..core.packing import GCB_SUBGROUP as SUBGROUP
from ..core.packing import TILE, pack_codes, pack_stream, pad_rows, unpack_codes, unpack_stream
from ..ops import Backend
from ..ops.gcb import gcb_linear, register_reference_cpu_impls
from ..ops.lut_i8 import lut_i8_linear
from .base import Layout, register_layout


def _sub_group_bytes(q: dict[str, Tensor]) -> Tensor:
    return ((q["codebook_index"].to(torch.int32) << 4) | q["sub_scales"].to(torch.int32)).to(torch.uint8)


def _split_sub_group_bytes(sub: Tensor) -> dict[str, Tensor]:
    s = sub.to(torch.int32)
    return {"codebook_index": (s >> 4).to(torch.uint8), "sub_scales": (s & 15).to(torch.uint8)}


class GcbRowMajor(Layout):
    name = "gcb_rowmajor"
    version = 1
    isa_paths = False  # its CPU impl is plain torch: one path

    def supports(self, fmt) -> bool:
        return isinstance(fmt, GroupCodebook)

    def pack(self, fmt: GroupCodebook, q: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"codes": pack_stream(q["codes"], fmt.bits), "sub_groups": _sub_group_bytes(q).contiguous(),
                "super_scales": q["super_scales"].contiguous(), "codebooks": q["codebooks"].contiguous()}

    def unpack(self, fmt: GroupCodebook, buffers: dict[str, Tensor], out_features: int,
               in_features: int) -> dict[str, Tensor]:
        return {"codes": unpack_stream(buffers["codes"], fmt.bits, in_features).to(torch.uint8),
                **_split_sub_group_bytes(buffers["sub_groups"]),
                "super_scales": buffers["super_scales"], "codebooks": buffers["codebooks"]}

    def buffer_shapes(self, fmt: GroupCodebook, out_features: int, in_features: int):
        return {"codes": ((out_features, -(-in_features * fmt.bits // 32)), torch.int32),
                "sub_groups": ((out_features, in_features // SUBGROUP), torch.uint8),
                "super_scales": ((out_features, in_features // fmt.superblock), torch.float16),
                "codebooks": (tuple(fmt.table().shape), torch.int8)}

    def kernel_ops(self, fmt) -> tuple:
        return (("gcb_linear", "lowbit"),)

    def fused_op(self, fmt: GroupCodebook, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
                 backend: Backend) -> Tensor:
        return gcb_linear(x, buffers["codes"], fmt.bits, buffers["sub_groups"], buffers["super_scales"],
                          buffers["codebooks"], bias, backend=backend)

    def linear(self, fmt: GroupCodebook, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        return self.fused_op(fmt, buffers, x, bias, backend)


class GcbI8Tiled(Layout):
    name = "gcb_i8_n16"
    version = 1
    backends = ("cpu",)

    def supports(self, fmt) -> bool:
        return isinstance(fmt, GroupCodebook)

    def _check(self, fmt):
        if not self.supports(fmt):
            raise ValueError(f"layout {self.name} holds gcb formats only, not {fmt.name}")

    @staticmethod
    def _tiled(t: Tensor, tiles: int) -> Tensor:  # [N, X] -> [tiles, X, 16]
        return pad_rows(t, tiles * TILE).reshape(tiles, TILE, -1).permute(0, 2, 1).contiguous()

    @staticmethod
    def _untiled(t: Tensor, out_features: int) -> Tensor:
        return t.permute(0, 2, 1).reshape(t.shape[0] * TILE, -1)[:out_features]

    def pack(self, fmt: GroupCodebook, q: dict[str, Tensor]) -> dict[str, Tensor]:
        self._check(fmt)
        qweight = pack_codes(q["codes"], fmt.bits)
        tiles = qweight.shape[0]
        return {"qweight": qweight, "sub_groups": self._tiled(_sub_group_bytes(q), tiles),
                "super_scales": self._tiled(q["super_scales"], tiles), "codebooks": q["codebooks"].contiguous()}

    def unpack(self, fmt: GroupCodebook, buffers: dict[str, Tensor], out_features: int,
               in_features: int) -> dict[str, Tensor]:
        return {"codes": unpack_codes(buffers["qweight"], fmt.bits, out_features),
                **_split_sub_group_bytes(self._untiled(buffers["sub_groups"], out_features)),
                "super_scales": self._untiled(buffers["super_scales"], out_features),
                "codebooks": buffers["codebooks"]}

    def buffer_shapes(self, fmt: GroupCodebook, out_features: int, in_features: int):
        tiles = -(-out_features // TILE)
        return {"qweight": ((tiles, in_features // 32, 64 * fmt.bits), torch.uint8),
                "sub_groups": ((tiles, in_features // SUBGROUP, TILE), torch.uint8),
                "super_scales": ((tiles, in_features // fmt.superblock, TILE), torch.float16),
                "codebooks": (tuple(fmt.table().shape), torch.int8)}

    def reference_activations(self, x: Tensor, fmt=None, buffers=None) -> Tensor:
        return fake_quantize_q8_blocks(x)

    def kernel_ops(self, fmt) -> tuple:
        return (("lut_i8_linear", None),)

    def linear(self, fmt: GroupCodebook, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        if backend != "cpu" or x.device.type != "cpu":
            raise RuntimeError(f"layout {self.name} runs on the CPU backend only; repack the module with "
                               "QuantLinear.repack(...) to gcb_rowmajor for other devices")
        qweight, scales, mins, lut, bits, group, sub_groups, _, _ = self.lut_i8_args(fmt, buffers)
        return lut_i8_linear(x, qweight, scales, mins, lut, bits, group, out_features, bias, sub_groups=sub_groups,
                             backend=backend)

    def lut_i8_args(self, fmt: GroupCodebook, buffers: dict[str, Tensor]) -> Optional[tuple]:
        return (buffers["qweight"], buffers["super_scales"], None, buffers["codebooks"].reshape(-1), fmt.bits,
                fmt.superblock, buffers["sub_groups"], None, None)


def _decode_rowmajor(in_features, codes, code_bits, sub_groups, super_scales, codebooks):
    """The reference decode of gcb_rowmajor buffers (the gcb ops' CPU impls)."""
    s = sub_groups.to(torch.int32)
    return dequantize_subgroups(unpack_stream(codes, code_bits, in_features), s >> 4, s & 15, super_scales, codebooks)


register_reference_cpu_impls(_decode_rowmajor)
GCB_ROWMAJOR = register_layout(GcbRowMajor(), default_for="gcb")
GCB_I8 = register_layout(GcbI8Tiled(), default_for="gcb", device="cpu")
