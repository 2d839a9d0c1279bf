"""q4_{R}x{S}: the interleaved ARM layouts of the 4-bit formats with an int8 table and no mins (q4_0,
iq4_nl, int4_pc): llama.cpp's Q4_0_4_4 (R = 4 rows, chunks of S = 4 bytes: sdot by lane), Q4_0_4_8
and Q4_0_8_8 (S = 8: the 2x8 operands of i8mm's smmla), the seed paper's SIMD-aware interleaving.

qweight [ceil(N/R), K/32, 16 R] uint8 (torch_lowbit.core.packing.interleave_nibble_rows; tables c - 8 stored
with each nibble's top bit toggled, so the kernel reads signed nibbles with one shift or mask),
scales [ceil(N/R), K/group, R] fp16. The kernels (torch_lowbit::q4x_linear: csrc/common/q4x.h, ARM
code in csrc/arm/q4x_*.cpp, scalar elsewhere) compute exactly what the lut4_i8_n16 kernels compute
for the same weights, so a model repacked between the two gives the same bytes.

On an ARM CPU with i8mm, `quantize_` picks q4_8x8 for these formats; with dotprod, q4_4x4; elsewhere the
x86 tiles (lut4_i8_n16). A checkpoint packed in one of these CPU layouts loads on any CPU and is
repacked to that CPU's own (nn.checkpoint, with an info log line).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.activations import KERNEL_ACT_BLOCKS, fake_quantize_q8_blocks
from ..formats.scalar import ScalarCodebookFormat, dequantize_groups
from ..core.packing import (deinterleave_nibble_rows, interleave_nibble_bytes, interleave_nibble_rows,
                            interleaved_rows_codes, pad_rows)
from ..ops.q4x import q4x_linear, register_reference_cpu_impls
from .base import Layout, register_cpu_preference, register_layout
from .lut_i8 import int8_table


_TOGGLED: dict = {}  # format -> whether its table is c - 8, filled eagerly (pack, runtime_buffers)


def _toggled(fmt: ScalarCodebookFormat) -> bool:
    """Whether the layout stores fmt's nibbles toggled (its table is c - 8). Decided once per format
    outside any traced graph (compile cannot read a table's values); traced code reads the cache."""
    if fmt not in _TOGGLED:
        _TOGGLED[fmt] = _is_toggled_table(fmt.code_values())
    return _TOGGLED[fmt]


def _is_toggled_table(values: Tensor) -> bool:
    """Whether a 4-bit table is c - 8 (the layout stores such codes with the nibble's top bit toggled)."""
    return bool(torch.equal(values.float(), torch.arange(16, dtype=torch.float32) - 8))


def _untile(scales: Tensor, out_features: int) -> Tensor:
    """Per-row scales [N, G] of the interleaved [N/R, G, R]."""
    return scales.permute(0, 2, 1).reshape(-1, scales.shape[1])[:out_features]


class Q4xInterleaved(Layout):
    version = 1
    backends = ("cpu",)
    cpu_specific = True  # chosen per CPU; checkpoints in it are repacked to the loading CPU's choice
    isa_paths = False  # x86 runs the scalar kernel on every path; the ARM paths are checked under qemu

    def __init__(self, rows: int, chunk: int):
        self.rows, self.chunk = rows, chunk
        self.name = f"q4_{rows}x{chunk}"

    def supports(self, fmt) -> bool:
        return (isinstance(fmt, ScalarCodebookFormat) and fmt.code_bits == 4 and not fmt.has_mins
                and fmt.group_size % 32 == 0 and int8_table(fmt) is not None)

    def _check(self, fmt):
        if not self.supports(fmt):
            raise ValueError(f"layout {self.name} holds 4-bit formats with an integer table and no mins (q4_0, "
                             f"iq4_nl, int4_pc), not {fmt.name}: use lut4_i8_n16 or lut4_rowmajor")

    def pack(self, fmt: ScalarCodebookFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        self._check(fmt)
        return self._with_scales(q, interleave_nibble_rows(q["codes"], self.rows, self.chunk, _toggled(fmt)))

    def pack_row_bytes(self, fmt: ScalarCodebookFormat, q: dict[str, Tensor]) -> dict[str, Tensor]:
        self._check(fmt)
        return self._with_scales(q, interleave_nibble_bytes(q["codes"], self.rows, self.chunk, _toggled(fmt)))

    def _with_scales(self, q: dict[str, Tensor], qweight: Tensor) -> dict[str, Tensor]:
        """The buffers: qweight and the scales interleaved as it is."""
        groups = qweight.shape[0]
        scales = pad_rows(q["scales"], groups * self.rows).reshape(groups, self.rows, -1).permute(0, 2, 1)
        return {"qweight": qweight, "scales": scales.contiguous()}

    def unpack(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], out_features: int,
               in_features: int) -> dict[str, Tensor]:
        codes = deinterleave_nibble_rows(buffers["qweight"], self.rows, self.chunk, _toggled(fmt), out_features)
        return {"codes": codes, "scales": _untile(buffers["scales"], out_features)}

    def gather_rows(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        # no _check: it reads the table's values, which compile cannot trace (pack checked the format)
        codes = interleaved_rows_codes(buffers["qweight"], self.rows, self.chunk, _toggled(fmt), rows)
        return {"codes": codes, "scales": buffers["scales"][rows // self.rows, :, rows % self.rows]}

    def buffer_shapes(self, fmt: ScalarCodebookFormat, out_features: int, in_features: int):
        groups = -(-out_features // self.rows)
        return {"qweight": ((groups, in_features // 32, 16 * self.rows), torch.uint8),
                "scales": ((groups, in_features // fmt.group_size, self.rows), torch.float16)}

    def runtime_buffers(self, fmt) -> dict[str, Tensor]:
        self._check(fmt)
        _toggled(fmt)  # cached before any compiled forward or lookup reads it
        return {"lut_i8": int8_table(fmt)}

    def reference_activations(self, x: Tensor, fmt=None, buffers=None) -> Tensor:
        return fake_quantize_q8_blocks(x)

    def kernel_ops(self, fmt) -> tuple:
        return (("q4x_linear", None),)

    def _run(self, fmt, buffers, x, bias, backend, out_features, act_bits=0, act_clip=1.0, act_block=0) -> Tensor:
        if backend != "cpu" or x.device.type != "cpu":
            raise RuntimeError(f"layout {self.name} runs on the CPU backend only; repack the module with "
                               "QuantLinear.repack(\"lut4_rowmajor\") for Triton/CUDA")
        return q4x_linear(x, buffers["qweight"], buffers["scales"], buffers["lut_i8"], self.rows, self.chunk,
                          fmt.group_size, out_features, bias, act_bits=act_bits, act_clip=act_clip,
                          act_block=act_block, backend=backend)

    def linear(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        return self._run(fmt, buffers, x, bias, backend, out_features)

    def linear_int_acts(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor,
                        bias: Optional[Tensor], backend: str, out_features: int, bits: int,
                        clip: float, block: int = 0) -> Optional[Tensor]:
        if backend != "cpu" or x.device.type != "cpu" or block not in (0,) + KERNEL_ACT_BLOCKS:
            return None
        return self._run(fmt, buffers, x, bias, backend, out_features, bits, clip, block)


def _decode_interleaved(qweight, scales, lut, rows, chunk, group_size, out_features):
    """The reference decode of these layouts' buffers, fp32 W [N, K] (q4x_linear's CPU reference without the
    extension); the int8 table says whether the nibbles are stored toggled."""
    codes = deinterleave_nibble_rows(qweight, rows, chunk, _is_toggled_table(lut), out_features)
    return dequantize_groups(lut.float(), codes, _untile(scales, out_features), None, group_size)


register_reference_cpu_impls(_decode_interleaved)
Q4X = {(r, s): register_layout(Q4xInterleaved(r, s)) for r, s in ((4, 4), (4, 8), (8, 8))}


def _arm_choice(fmt) -> Optional[Layout]:
    """The interleaved layout of this CPU's best ARM path, or None (x86, plain NEON). By the instruction counts of
    docs/kernels/arm.md: i8mm -> q4_8x8 (0.18 instructions per weight and token in token pairs, 0.28 for one
    token), dotprod -> q4_4x4 (0.28)."""
    from ..ops import cpu_extension, has_cpu_extension
    if not has_cpu_extension():
        return None  # no ARM kernels to pick a layout for: the portable default runs its reference
    paths = cpu_extension().available_cpu_paths()
    for path, key in (("i8mm", (8, 8)), ("dotprod", (4, 4))):
        if path in paths and Q4X[key].supports(fmt):
            return Q4X[key]
    return None


register_cpu_preference(_arm_choice)
