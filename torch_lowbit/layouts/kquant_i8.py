"""kquant_i8_n16: the K-quant formats (q2_k .. q6_k) in the int8-activation tiles of lut_i8_linear, the
CPU layout they run in (AVX-512 VNNI, AVX2, NEON, portable scalar).

The codes are the lut{b}_i8_n16 tiles of their width (core/packing.py: b = 2, 3, 4; 5 as 4 + 1 and 6
as 4 + 2 planes), read through the identity table minus the format's offset (q3_k 4, q6_k 32), so
no lookup. The two-level scales stay integers: sub_scales int8 [N/16, K/sub-block, 16] and, for the
affine types, sub_mins uint8; scales are the super-blocks' fp16 d and mins their -dmin, all tiled 16
rows at a time like the codes. The kernels weight each sub-block's integer dot product by its
sub-scale in int32 and apply d and dmin once per super-block (csrc/common/lut_i8.h, "integer
sub-scales"). Every field of the GGUF block is kept, so unpack gives back the format's tensors and
to_gguf the file's bytes.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.activations import fake_quantize_q8_blocks
from ..core.kquant_blocks import SUPER_BLOCK
from ..core.packing import TILE, pack_codes, pad_rows, tile_rows_codes, unpack_codes
from ..formats.kquants import KQuantFormat
from ..ops.lut_i8 import lut_i8_linear
from .base import Layout, register_layout
from .lut_i8 import untile_rows


def tile_params(t: Tensor, tiles: int) -> Tensor:
    """Per-row parameters [N, G] as [tiles, G, 16] (rows padded with zeros): a tile's 16 rows together."""
    return pad_rows(t, tiles * TILE).reshape(tiles, TILE, -1).permute(0, 2, 1).contiguous()


class KQuantI8Tiled(Layout):
    name = "kquant_i8_n16"
    version = 1
    backends = ("cpu",)
    cpu_specific = True

    def supports(self, fmt) -> bool:
        return isinstance(fmt, KQuantFormat)

    def pack(self, fmt: KQuantFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        qweight = pack_codes(q["codes"], fmt.code_bits)
        tiles = qweight.shape[0]
        out = {"qweight": qweight, "scales": tile_params(q["d"], tiles),
               "sub_scales": tile_params(q["sub_scales"].view(torch.int8), tiles)}  # 0..63 or int8: one byte
        if fmt.has_mins:
            out["mins"] = tile_params(-q["dmin"], tiles)  # the kernels add mins * sum: -dmin (exact)
            out["sub_mins"] = tile_params(q["sub_mins"], tiles)
        return out

    def _params(self, fmt: KQuantFormat, tiled: dict[str, Tensor], untile) -> dict[str, Tensor]:
        q = {"d": untile(tiled["scales"]), "sub_scales": untile(tiled["sub_scales"]).view(fmt.scale_dtype)}
        if fmt.has_mins:
            q["dmin"] = -untile(tiled["mins"])
            q["sub_mins"] = untile(tiled["sub_mins"])
        return q

    def unpack(self, fmt: KQuantFormat, buffers: dict[str, Tensor], out_features: int,
               in_features: int) -> dict[str, Tensor]:
        q = {"codes": unpack_codes(buffers["qweight"], fmt.code_bits, out_features)}
        q.update(self._params(fmt, buffers, lambda t: untile_rows(t, out_features).contiguous()))
        return q

    def gather_rows(self, fmt: KQuantFormat, buffers: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        q = {"codes": tile_rows_codes(buffers["qweight"], fmt.code_bits, rows)}
        q.update(self._params(fmt, buffers, lambda t: t[rows // TILE, :, rows % TILE]))
        return q

    def buffer_shapes(self, fmt: KQuantFormat, out_features: int, in_features: int):
        tiles, supers, subs = -(-out_features // TILE), in_features // SUPER_BLOCK, in_features // fmt.sub_block
        shapes = {"qweight": ((tiles, in_features // 32, 64 * fmt.code_bits), torch.uint8),
                  "scales": ((tiles, supers, TILE), torch.float16),
                  "sub_scales": ((tiles, subs, TILE), torch.int8)}
        if fmt.has_mins:
            shapes["mins"] = ((tiles, supers, TILE), torch.float16)
            shapes["sub_mins"] = ((tiles, subs, TILE), torch.uint8)
        return shapes

    def runtime_buffers(self, fmt: KQuantFormat) -> dict[str, Tensor]:
        # the codes as they are, less the symmetric types' offset (q3_k: code - 4, q6_k: code - 32)
        return {"lut_i8": (torch.arange(2 ** fmt.code_bits) - fmt.code_offset).to(torch.int8)}

    def reference_activations(self, x: Tensor, fmt=None, buffers=None) -> Tensor:
        return fake_quantize_q8_blocks(x)

    def kernel_ops(self, fmt) -> tuple:
        return super().kernel_ops(fmt) + (("lut_i8_linear", None),)

    def lut_i8_args(self, fmt: KQuantFormat, buffers: dict[str, Tensor]) -> Optional[tuple]:
        return (buffers["qweight"], buffers["scales"], buffers.get("mins"), buffers["lut_i8"], fmt.code_bits,
                SUPER_BLOCK, None, buffers["sub_scales"], buffers.get("sub_mins"))

    def linear(self, fmt: KQuantFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        if backend != "cpu" or x.device.type != "cpu":
            raise RuntimeError(f"layout {self.name} runs on the CPU backend only; repack the module with "
                               "QuantLinear.repack('kquant_stream') for other devices")
        qweight, scales, mins, lut, bits, group, _, sub_scales, sub_mins = self.lut_i8_args(fmt, buffers)
        return lut_i8_linear(x, qweight, scales, mins, lut, bits, group, out_features, bias, sub_scales=sub_scales,
                             sub_mins=sub_mins, backend=backend)


KQUANT_I8 = register_layout(KQuantI8Tiled(), default_for="ggml_k", device="cpu")
