"""lut{b}_i8_n16 (b = 1..4, 8): the x86 CPU layouts of formats whose b-bit codes index a table of
integers (q4_0, int4_g*, iq4_nl; nuq* through nuq_i8_n16; b = 8: q8_0), run by int8-activation
kernels (AVX-512 VNNI, AVX2, portable scalar).

Rows are tiled by 16 (N padded with zero codes and scales), K by blocks of 32. A (tile, block) is
64 b bytes: the code splits into planes of width 4 (b = 4), 2 (b = 2), 2 + 1 (b = 3), 1 (b = 1)
or 8 (b = 8); a width-w plane takes w chunks of 64 bytes, and quad qd (codes 4qd .. 4qd+3, qd < 8)
lies in chunk qd % w at bit offset w * (qd // w), byte r*4 + j holding row r's code 4qd + j. One
64-byte load, a shift and a mask thus feed vpdpbusd with 4 codes of each of 16 rows.

lut8_i8_n16 (q8_0) is the b = 8 case: qweight [N/16, K/32, 512] uint8, chunk qd of a (tile, block)
= quad qd, its byte r*4 + j = row r's code 4qd + j = q + 128 (the unsigned operand of vpdpbusd;
the kernel subtracts 128 * sum(x) per block, AVX2 flips the byte back to q for its sign trick), so a
decode GEMV streams each weight byte once, 8 plain 64-byte loads per (tile, block), no shifts. A
row's bytes are 4 of every 64, so an embedding lookup gathers exactly a row's K bytes
(`gather_rows`). Group params are [N/16, K/group, 16] fp16 (q8_0: one d per block): a tile's 16
scales of one group convert in one op. See csrc/common/lut_i8.h for the kernel's integer math.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.activations import KERNEL_ACT_BLOCKS, fake_quantize_q8_blocks, fake_quantize_q8_pair_blocks
from ..formats.gcb import dequantize_subgroups
from ..formats.palette import NUQ, VQ
from ..formats.scalar import ScalarCodebookFormat, dequantize_groups
from ..core.packing import (LUT_I8_CODE_BITS, TILE, pack_codes, pad_rows, tile_row_bytes, tile_rows_codes,
                            unpack_codes)
from ..ops.lut_i8 import lut_i8_linear, register_reference_cpu_impls
from ..rotations import hadamard_transform
from .base import Layout, register_cpu_preference, register_layout


def int8_table(fmt) -> Optional[Tensor]:
    """The format's code values as int8 when they are integers in int8 range (else None)."""
    v = fmt.code_values()
    if bool((v == v.round()).all()) and v.min() >= -128 and v.max() <= 127 and v.max() - v.min() <= 255:
        return v.round().to(torch.int8)
    return None


def untile_rows(t: Tensor, out_features: int) -> Tensor:
    """Per-row parameters [N, G] of tiled ones [N/16, G, 16] (scales, mins, sub-group bytes)."""
    return t.permute(0, 2, 1).reshape(t.shape[0] * TILE, -1)[:out_features]


class LutI8Tiled(Layout):
    """Group-wise scalar-codebook formats (codes, scales [, mins]) with b-bit integer tables."""

    version = 1
    backends = ("cpu",)
    cpu_specific = True  # the x86 tiles (ARM's neon path reads them too)

    def __init__(self, bits: int):
        self.bits = bits
        self.name = f"lut{bits}_i8_n16"

    def supports(self, fmt) -> bool:
        return (isinstance(fmt, ScalarCodebookFormat) and fmt.code_bits == self.bits and fmt.group_size % 32 == 0
                and int8_table(fmt) is not None)

    def _check(self, fmt):
        if not self.supports(fmt):
            raise ValueError(f"layout {self.name} needs a {self.bits}-bit format with integer code values in int8 "
                             f"range and groups of 32k; {fmt.name} is not one: use its portable layout")

    def pack(self, fmt: ScalarCodebookFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        self._check(fmt)
        return self._with_params(fmt, q, pack_codes(q["codes"], self.bits))

    def pack_row_bytes(self, fmt: ScalarCodebookFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        self._check(fmt)
        return self._with_params(fmt, q, tile_row_bytes(q["codes"], self.bits))

    def _with_params(self, fmt: ScalarCodebookFormat, q: dict[str, Tensor], qweight: Tensor) -> dict[str, Tensor]:
        """The buffers: qweight and the group parameters tiled as it is."""
        out = {"qweight": qweight}
        tiles = qweight.shape[0]
        for name in ("scales", "mins") if fmt.has_mins else ("scales",):
            p = pad_rows(q[name], tiles * TILE)
            out[name] = p.reshape(tiles, TILE, -1).permute(0, 2, 1).contiguous()
        return out

    def unpack(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], out_features: int, in_features: int) -> dict[str, Tensor]:
        q = {"codes": unpack_codes(buffers["qweight"], self.bits, out_features)}
        for name in ("scales", "mins") if fmt.has_mins else ("scales",):
            q[name] = untile_rows(buffers[name], out_features)
        return q

    def gather_rows(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        # no _check here: it reads the table's values, which compile cannot trace (pack checked the format)
        q = {"codes": tile_rows_codes(buffers["qweight"], self.bits, rows)}
        for name in ("scales", "mins") if fmt.has_mins else ("scales",):
            q[name] = buffers[name][rows // TILE, :, rows % TILE]  # [n, groups]
        return q

    def buffer_shapes(self, fmt: ScalarCodebookFormat, out_features: int, in_features: int):
        tiles, groups = -(-out_features // TILE), in_features // fmt.group_size
        shapes = {"qweight": ((tiles, in_features // 32, 64 * self.bits), torch.uint8),
                  "scales": ((tiles, groups, TILE), torch.float16)}
        if fmt.has_mins:
            shapes["mins"] = ((tiles, groups, TILE), torch.float16)
        return shapes

    def runtime_buffers(self, fmt) -> dict[str, Tensor]:
        self._check(fmt)
        return {"lut_i8": int8_table(fmt)}

    def reference_activations(self, x: Tensor, fmt=None, buffers=None) -> Tensor:
        return fake_quantize_q8_blocks(x)

    def _run(self, x: Tensor, buffers: dict[str, Tensor], bits: int, group: int, bias, backend: str,
             out_features: int, act_bits: int = 0, act_clip: float = 1.0, act_block: int = 0) -> Tensor:
        if backend != "cpu" or x.device.type != "cpu":
            raise RuntimeError(f"layout {self.name} runs on the CPU backend only; repack the module with "
                               "QuantLinear.repack(...) to a portable layout (lut4_rowmajor, palette_dense) for "
                               "Triton/CUDA")
        return lut_i8_linear(x, buffers["qweight"], buffers["scales"], buffers.get("mins"), buffers["lut_i8"], bits,
                             group, out_features, bias, act_bits=act_bits, act_clip=act_clip, act_block=act_block,
                             backend=backend)

    def linear_int_acts(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor,
                        bias: Optional[Tensor], backend: str, out_features: int, bits: int,
                        clip: float, block: int = 0) -> Optional[Tensor]:
        if backend != "cpu" or x.device.type != "cpu" or block not in (0,) + KERNEL_ACT_BLOCKS:
            return None
        return self._run(x, buffers, self.bits, fmt.group_size, bias, backend, out_features, bits, clip, block)

    def kernel_ops(self, fmt) -> tuple:
        return super().kernel_ops(fmt) + (("lut_i8_linear", None),)  # nuq: the rotation first

    def linear(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        return self._run(x, buffers, self.bits, fmt.group_size, bias, backend, out_features)

    def lut_i8_args(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor]) -> Optional[tuple]:
        return (buffers["qweight"], buffers["scales"], buffers.get("mins"), buffers["lut_i8"], self.bits,
                fmt.group_size, None, None, None)


class NuqI8Tiled(LutI8Tiled):
    """nuq*: the same tiles, one scale per row (a single group of K), and the activations rotated
    before they are quantized to int8 (x' = (x * s) @ H, see formats/palette.py)."""

    format_class = NUQ
    weights_per_code = 1
    layout_name = "nuq_i8_n16"

    def __init__(self):
        self.bits = None  # the format's own code width
        self.name = self.layout_name

    def supports(self, fmt) -> bool:
        return isinstance(fmt, self.format_class)

    gather_rows = Layout.gather_rows  # one scale per row of rotated codes: no embedding use
    pack_row_bytes = Layout.pack_row_bytes  # its own pack (one scale per row), after unpacking

    def holds_width(self, fmt, in_features: int) -> bool:
        return in_features % (32 * self.weights_per_code) == 0  # whole int8 activation blocks (per coordinate)

    def _check(self, fmt):
        if not self.supports(fmt):
            raise ValueError(f"layout {self.name} holds {self.format_class.prefix} formats only (with integer "
                             f"tables), not {fmt.name}")

    def pack(self, fmt, q: dict[str, Tensor]) -> dict[str, Tensor]:
        self._check(fmt)
        if q["codes"].shape[1] % 32:
            raise ValueError(f"layout {self.name} needs in_features divisible by {32 * self.weights_per_code} (int8 "
                             f"activation blocks), got {q['codes'].shape[1] * self.weights_per_code}; use layout "
                             "palette_packed or palette_dense for this layer")
        qweight = pack_codes(q["codes"], fmt.code_bits)
        tiles = qweight.shape[0]
        scales = pad_rows(q["row_scales"], tiles * TILE).reshape(tiles, 1, TILE).contiguous()
        out = {"qweight": qweight, "scales": scales}
        if "signs" in q:
            out["signs"] = q["signs"].contiguous()
        return out

    def unpack(self, fmt, buffers: dict[str, Tensor], out_features: int, in_features: int) -> dict[str, Tensor]:
        q = {"codes": unpack_codes(buffers["qweight"], fmt.code_bits, out_features),
             "row_scales": buffers["scales"].reshape(-1)[:out_features]}
        if "signs" in buffers:
            q["signs"] = buffers["signs"]
        return q

    def buffer_shapes(self, fmt, out_features: int, in_features: int):
        tiles = -(-out_features // TILE)
        codes = in_features // self.weights_per_code
        shapes = {"qweight": ((tiles, codes // 32, 64 * fmt.code_bits), torch.uint8),
                  "scales": ((tiles, 1, TILE), torch.float16)}
        if fmt.rotate:
            shapes["signs"] = ((in_features,), torch.int8)
        return shapes

    def runtime_buffers(self, fmt) -> dict[str, Tensor]:
        self._check(fmt)
        return {"lut_i8": fmt.code_values().to(torch.int8)}

    def linear(self, fmt, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        xr = fmt.rotate_activations(x.float(), buffers.get("signs"))  # fp32: no second rounding of bf16 inputs
        return self._run(xr, buffers, fmt.code_bits, x.shape[-1], bias, backend, out_features).to(x.dtype)

    def linear_int_acts(self, *args, **kwargs) -> Optional[Tensor]:
        return None  # the kernel sees the rotated input; per-token rounding of x must come first

    def lut_i8_args(self, fmt, buffers: dict[str, Tensor]) -> Optional[tuple]:
        return None  # the activations are rotated (vq: also reordered) before the op

    def _kernel_activations(self, x: Tensor) -> Tensor:
        """The rotated activations as the kernel rounds them (int8 per 32 features, dequantized)."""
        return fake_quantize_q8_blocks(x)

    def reference_activations(self, x: Tensor, fmt=None, buffers=None) -> Tensor:
        # kernel: q8(x') @ W'^T with x' = x S H; as a product with W = W' H^T S that is
        # (q8(x') H^T S) @ W^T, so the effective activations are the rotation undone after q8.
        if not fmt.rotate:
            return self._kernel_activations(x)
        signs = buffers["signs"].float()
        return hadamard_transform(self._kernel_activations(fmt.rotate_activations(x, signs)), signs, inverse=True)


class VqI8Tiled(NuqI8Tiled):
    """vq1.5 / vq2 (2-D codebooks of <= 16 integer points): one code per pair of features in the
    same tiles (K/2 codes per row), the lut_i8 kernels' pair mode (csrc/common/lut_i8.h: one table
    per coordinate, [2, 2^b]); the op rounds x' to int8 in pair-split order (per 64 features, the 32
    first coordinates, then the 32 second ones)."""

    format_class = VQ
    weights_per_code = 2
    layout_name = "vq_i8_n16"

    def supports(self, fmt) -> bool:
        return super().supports(fmt) and fmt.integer_codebook

    def runtime_buffers(self, fmt) -> dict[str, Tensor]:
        self._check(fmt)
        return {"lut_i8": fmt.code_values().T.contiguous().to(torch.int8)}  # [2, 2^b]: one table per coordinate

    def _kernel_activations(self, x: Tensor) -> Tensor:
        return fake_quantize_q8_pair_blocks(x)


def _decode_tiles(qweight, scales, mins, lut, code_bits, group_size, out_features, sub_groups, sub_scales=None,
                  sub_mins=None):
    """The reference decode of the lut_i8 tiles, fp32 W [N, K] (lut_i8_linear's CPU reference without the
    extension): the scalar formats' groups (nuq: one group of K), vq's pair codebooks (one table per
    coordinate), gcb's sub-group codebooks or the K-quants' integer sub-scales."""
    codes = unpack_codes(qweight, code_bits, out_features)
    row_scales = untile_rows(scales, out_features)
    if sub_scales is not None:  # scale * sub_scale * lut[code] + min * sub_min
        n, k = codes.shape
        sub = k // sub_scales.shape[1]
        per_group = group_size // sub
        values = lut.float()[codes.long()].reshape(n, -1, sub)
        step = row_scales.float().repeat_interleave(per_group, dim=1) * untile_rows(sub_scales, n).float()
        w = values * step.unsqueeze(-1)
        if sub_mins is not None:
            low = untile_rows(mins, n).float().repeat_interleave(per_group, dim=1) * untile_rows(sub_mins, n).float()
            w = w + low.unsqueeze(-1)
        return w.reshape(n, k)
    if sub_groups is not None:
        s = untile_rows(sub_groups, out_features).to(torch.int32)
        return dequantize_subgroups(codes, s >> 4, s & 15, row_scales, lut.reshape(-1, 2 ** code_bits))
    if lut.dim() == 2:  # [2, 2^b]: a code per pair of features, coordinate c from table c
        pairs = lut.float().T[codes.long()].reshape(out_features, -1)
        return pairs * row_scales.float().repeat_interleave(group_size, dim=1)
    row_mins = untile_rows(mins, out_features) if mins is not None else None
    return dequantize_groups(lut.float(), codes, row_scales, row_mins, group_size)


register_reference_cpu_impls(_decode_tiles)
LUT_I8 = {b: register_layout(LutI8Tiled(b), default_for=f"lut{b}", device="cpu") for b in LUT_I8_CODE_BITS}
NUQ_I8 = register_layout(NuqI8Tiled(), default_for="nuq", device="cpu")
VQ_I8 = register_layout(VqI8Tiled())
register_cpu_preference(lambda fmt: VQ_I8 if VQ_I8.supports(fmt) else None)  # over palette_packed
