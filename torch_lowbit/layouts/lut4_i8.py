"""lut4_i8_n16: the x86 CPU layout of the 4-bit formats whose code values are integers (q4_0,
int4_g*, iq4_nl), run by int8-activation kernels (AVX-512 VNNI, portable scalar).

Rows are tiled by 16 (N padded with zero codes and scales), K by blocks of 32. Each (tile, block)
is 256 bytes: 4 chunks of 64, byte r*4 + j of chunk i holding row r's code 4i + j (low nibble) and
16 + 4i + j (high nibble), so one 64-byte load feeds vpdpbusd with 4 codes of each of 16 rows.
Group params are [N/16, K/group, 16] fp16: a tile's 16 scales of one group convert in one op.
See csrc/common/lut4_i8.h for the kernel's integer math.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..formats.activations import fake_quantize_q8_blocks
from ..formats.scalar import ScalarCodebookFormat
from .base import Layout, register_layout

TILE = 16


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


class Lut4I8Tiled(Layout):
    name = "lut4_i8_n16"
    version = 1
    backends = ("cpu",)

    def supports(self, fmt) -> bool:
        if not isinstance(fmt, ScalarCodebookFormat) or fmt.code_bits != 4 or fmt.group_size % 32:
            return False
        v = fmt.code_values()
        return bool((v == v.round()).all()) and v.min() >= -128 and v.max() <= 127 and v.max() - v.min() <= 255

    def _check(self, fmt):
        if not self.supports(fmt):
            raise ValueError(f"layout {self.name} needs a 4-bit format with integer code values in int8 range; "
                             f"{fmt.name} is not one: use layout lut4_rowmajor")

    def pack(self, fmt: ScalarCodebookFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        self._check(fmt)
        codes = q["codes"]
        n, k = codes.shape
        tiles = -(-n // TILE)
        c = _pad_rows(codes, tiles * TILE).reshape(tiles, TILE, k // 32, 2, 4, 4)  # t, r, b, half, i, j
        packed = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # t, r, b, i, j
        out = {"qweight": packed.permute(0, 2, 3, 1, 4).reshape(tiles, k // 32, 256).contiguous()}
        for name in ("scales", "mins") if fmt.has_mins else ("scales",):
            p = _pad_rows(q[name], tiles * TILE)
            out[name] = p.reshape(tiles, TILE, -1).permute(0, 2, 1).contiguous()
        return out

    def unpack(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], out_features: int) -> dict[str, Tensor]:
        qw = buffers["qweight"]
        tiles, kb, _ = qw.shape
        b = qw.reshape(tiles, kb, 4, TILE, 4).permute(0, 3, 1, 2, 4)  # t, r, b, i, j
        codes = torch.stack((b & 0x0F, b >> 4), dim=3)  # t, r, b, half, i, j
        q = {"codes": codes.reshape(tiles * TILE, kb * 32)[:out_features]}
        for name in ("scales", "mins") if fmt.has_mins else ("scales",):
            q[name] = buffers[name].permute(0, 2, 1).reshape(tiles * TILE, -1)[:out_features]
        return q

    def buffer_shapes(self, fmt: ScalarCodebookFormat, out_features: int, in_features: int):
        tiles, groups = -(-out_features // TILE), in_features // fmt.group_size
        shapes = {"qweight": ((tiles, in_features // 32, 256), torch.uint8),
                  "scales": ((tiles, groups, TILE), torch.float16)}
        if fmt.has_mins:
            shapes["mins"] = ((tiles, groups, TILE), torch.float16)
        return shapes

    def runtime_buffers(self, fmt: ScalarCodebookFormat) -> dict[str, Tensor]:
        self._check(fmt)
        return {"lut_i8": fmt.code_values().round().to(torch.int8)}

    def reference_activations(self, x: Tensor) -> Tensor:
        return fake_quantize_q8_blocks(x)

    def linear(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        if backend != "cpu" or x.device.type != "cpu":
            raise RuntimeError(f"layout {self.name} runs on the CPU backend only; repack the module with "
                               "QuantLinear.repack('lut4_rowmajor') (or quantize with that layout) for Triton/CUDA")
        return torch.ops.torch_lowbit.lut4_i8_linear(x, buffers["qweight"], buffers["scales"], buffers.get("mins"),
                                                     buffers["lut_i8"], fmt.group_size, out_features, bias)


LUT4_I8 = register_layout(Lut4I8Tiled(), default_for="lut4", device="cpu")
