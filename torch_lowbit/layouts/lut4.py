"""lut4_rowmajor: the layout of every 4-bit scalar-codebook format (q4_0, int4_g*).

qweight [N, K/2] uint8, 32 codes per 16 bytes: byte j of a 32-code run holds code j in its low
nibble and code j+16 in its high nibble (ggml's Q4_0 block order: a GGUF Q4_0 block's qs bytes are
these bytes as they are). scales/mins [N, K/group] fp16. The kernels (csrc/common/lut4.h,
triton_kernels/lut4.py) read this and a 16-entry fp32 table of code values taken from the format.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.activations import KERNEL_ACT_BLOCKS
from ..formats.scalar import ScalarCodebookFormat, dequantize_groups
from ..core.packing import pack_nibbles, unpack_nibbles
from ..ops import Backend
from ..ops.lut4 import lut4_int_linear, lut4_linear, register_reference_cpu_impls
from .base import register_layout
from .lut_i8 import int8_table
from .scalar_rowmajor import ScalarRowMajor


class Lut4RowMajor(ScalarRowMajor):
    name = "lut4_rowmajor"
    version = 1
    codes_key, op, kernels = "qweight", "lut4_linear", "lut4"

    def supports(self, fmt) -> bool:
        return isinstance(fmt, ScalarCodebookFormat) and fmt.code_bits == 4 and fmt.group_size % 32 == 0

    def pack_codes(self, fmt: ScalarCodebookFormat, codes: Tensor) -> Tensor:
        return pack_nibbles(codes)

    def unpack_codes(self, fmt: ScalarCodebookFormat, packed: Tensor, in_features: int) -> Tensor:
        return unpack_nibbles(packed)

    def codes_shape(self, fmt: ScalarCodebookFormat, out_features: int, in_features: int) -> tuple:
        return (out_features, in_features // 2), torch.uint8

    def fused_op(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
                 backend: Backend) -> Tensor:
        return lut4_linear(x, buffers["qweight"], buffers["scales"], buffers.get("mins"), buffers["lut"],
                           fmt.group_size, bias, backend=backend)

    def runtime_buffers(self, fmt: ScalarCodebookFormat) -> dict[str, Tensor]:
        out = super().runtime_buffers(fmt)
        table = int8_table(fmt)
        if table is not None:  # integer tables (q4_0, int4_*, iq4_nl): the integer-activation kernel's
            out["lut_i8"] = table
        return out

    def linear_int_acts(self, fmt: ScalarCodebookFormat, buffers: dict[str, Tensor], x: Tensor,
                        bias: Optional[Tensor], backend: str, out_features: int, bits: int,
                        clip: float, block: int = 0) -> Optional[Tensor]:
        """Triton / CUDA: a first kernel rounds x per token (or per 32 features, blocks 32 / 16 / 8) and
        the matmul multiplies int8 x int8 with tl.dot (triton_kernels/int_act.py). The CPU backend keeps
        the float lut4 kernel on the rounded x (the int8 tiles are lut{b}_i8_n16); wider activation
        blocks are rounded in torch."""
        if (block and block not in KERNEL_ACT_BLOCKS) or "lut_i8" not in buffers or \
                (backend != "triton" and x.device.type != "cuda"):
            return None
        y = lut4_int_linear(x.reshape(-1, x.shape[-1]), buffers["qweight"], buffers["scales"], buffers.get("mins"),
                            buffers["lut_i8"], fmt.group_size, bias, bits, float(clip), block, backend=backend)
        return y.to(x.dtype).reshape(*x.shape[:-1], out_features)

    def kernel_ops(self, fmt) -> tuple:
        return super().kernel_ops(fmt) + ((("lut4_int_linear", "int_act"),) if int8_table(fmt) is not None else ())


def _decode(in_features, qweight, scales, mins, lut, group_size):
    """The reference decode of this layout's buffers (the lut4 ops' CPU references without the extension)."""
    return dequantize_groups(lut, unpack_nibbles(qweight), scales, mins, group_size)


register_reference_cpu_impls(_decode)
LUT4_ROWMAJOR = register_layout(Lut4RowMajor(), default_for="lut4")
