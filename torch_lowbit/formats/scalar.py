"""Scalar-codebook group formats: each weight is a small code whose value is table[code] * scale
(+ min), with one fp16 scale (and min) per group of consecutive input features.

Uniform INT formats (table = integers), q4_0 (table = -8..7) and non-uniform tables (IQ4_NL, NUQ)
are all this family, so one reference dequantizer serves them and one kernel family (lut4) runs
every 4-bit member: the format hands the kernel its table, the kernel never re-derives the format.
"""
from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import ClassVar, Optional

import torch
from torch import Tensor

from ..core.packing import ROW_BYTE_CODE_BITS
from .base import Format

FP16_MAX = 65504.0


def dequantize_groups(table: Tensor, codes: Tensor, scales: Tensor, mins: Optional[Tensor], group_size: int) -> Tensor:
    """fp32 W [N, K] = table[codes] * scale (+ min), one fp16 scale (and min) per group of K: the
    family's reference dequantizer (also the portable CPU impl of the lowbit ops)."""
    w = table.to(codes.device)[codes.long()] * scales.float().repeat_interleave(group_size, dim=1)
    if mins is not None:
        w = w + mins.float().repeat_interleave(group_size, dim=1)
    return w


@dataclasses.dataclass(frozen=True)
class ScalarCodebookFormat(Format):
    code_bits: ClassVar[int] = 4
    has_mins: ClassVar[bool] = False

    @property
    def layout_family(self) -> str:
        """b-bit codes + a 2^b-entry table: the lut{b} layouts and kernels."""
        return f"lut{self.code_bits}"

    @abstractmethod
    def code_values(self) -> Tensor:
        """fp32 [2**code_bits]: the value each code stands for, before scaling."""

    @abstractmethod
    def fit_groups(self, x: Tensor, importance: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """fp32 group parameters (scale [.., G, 1], min [.., G, 1] or None) for groups x [.., G, g].

        importance (broadcastable to x, >= 0): per-weight weights of the squared error to minimize,
        e.g. the mean squared calibration activation of each input feature (llama.cpp's imatrix).
        None: the format's plain data-free rule."""

    def encode(self, x: Tensor, scale: Tensor, mn: Optional[Tensor]) -> Tensor:
        """uint8 codes of the nearest representable values to x, given (broadcastable) group params."""
        values = self.code_values().to(x.device)
        target = x if mn is None else x - mn
        safe = torch.where(scale != 0, scale, torch.ones_like(scale))
        # Table values are sorted: nearest code = number of midpoints below x / scale.
        mids = (values[1:] + values[:-1]) / 2
        return torch.bucketize(target / safe, mids).to(torch.uint8)

    def quantize(self, weight: Tensor, importance: Optional[Tensor] = None) -> dict[str, Tensor]:
        """Round-to-nearest: fit each group's parameters, store them in fp16, encode against those.
        importance [in_features]: optional per-input-feature error weights (see fit_groups)."""
        x = self._groups(weight)
        scale, mn = self.fit_groups(x, self._importance_groups(importance, weight.shape[1]))
        return self.pack_params(weight.shape, x, scale, mn)

    def _importance_groups(self, importance: Optional[Tensor], in_features: int) -> Optional[Tensor]:
        if importance is None:
            return None
        if importance.shape != (in_features,) or not bool(torch.isfinite(importance).all()) or \
                bool((importance < 0).any()):
            raise ValueError(f"{self.name}: importance must be {in_features} finite non-negative values "
                             "(one per input feature)")
        imp = importance.detach().float()
        imp = imp / imp.mean().clamp_min(1e-30) + 1e-6  # scale-free; no group left without weight
        return imp.reshape(in_features // self.group_size, self.group_size)

    def pack_params(self, shape, x: Tensor, scale: Tensor, mn: Optional[Tensor]) -> dict[str, Tensor]:
        """The format's tensors for groups x with fp32 params: params rounded to fp16, codes encoded
        against the rounded params (what dequantize will see)."""
        scale16 = scale.half()
        mn16 = mn.half() if mn is not None else None
        codes = self.encode(x, scale16.float(), mn16.float() if mn16 is not None else None)
        q = {"codes": codes.reshape(shape), "scales": scale16.reshape(shape[0], -1)}
        if self.has_mins:
            q["mins"] = mn16.reshape(shape[0], -1)
        return q

    def check_quantized(self, q: dict[str, Tensor], out_features: int, in_features: int, *,
                        codes_as_row_bytes: bool = False) -> None:
        if codes_as_row_bytes and self.code_bits not in ROW_BYTE_CODE_BITS:
            raise ValueError(f"{self.name}: {self.code_bits}-bit codes have no row-byte form; pass one code per byte")
        super().check_quantized(q, out_features, in_features)
        groups = in_features // self.group_size
        code_columns = in_features * self.code_bits // 8 if codes_as_row_bytes else in_features
        expected = {"codes": ((out_features, code_columns), torch.uint8),
                    "scales": ((out_features, groups), torch.float16)}
        if self.has_mins:
            expected["mins"] = ((out_features, groups), torch.float16)
        if set(q) != set(expected):
            raise ValueError(f"{self.name}: quantized tensors must be exactly {sorted(expected)}, got {sorted(q)}")
        for name, (shape, dtype) in expected.items():
            t = q[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{self.name}: {name} must be {dtype} {list(shape)}, got {t.dtype} "
                                 f"{list(t.shape)}; convert it (e.g. codes as uint8, scales with .half())")
        # every nibble or byte of the row-byte form is a valid code: nothing to scan
        if self.code_bits < 8 and not codes_as_row_bytes and int(q["codes"].max()) >= 1 << self.code_bits:
            raise ValueError(f"{self.name}: codes must be below {1 << self.code_bits} ({self.code_bits}-bit), "
                             f"got {int(q['codes'].max())}")
        if not all(bool(torch.isfinite(q[n]).all()) for n in expected if n != "codes"):
            raise ValueError(f"{self.name}: scales/mins hold NaN/Inf; fix the source tensors")

    def bits_per_weight(self) -> float:
        params = 16 * (2 if self.has_mins else 1)
        return self.code_bits + params / self.group_size

    def dequantize(self, q: dict[str, Tensor]) -> Tensor:
        return dequantize_groups(self.code_values(), q["codes"], q["scales"], q["mins"] if self.has_mins else None,
                                 self.group_size)

    def _groups(self, weight: Tensor) -> Tensor:
        """[out, in] -> fp32 [out, in/group, group], after the format's input checks."""
        self.check_weight(weight)
        if float(weight.detach().abs().max()) > FP16_MAX / 2:
            raise ValueError(f"{self.name}: |weight| exceeds the fp16 range of the group scales; "
                             "rescale the layer or use a format with fp32 scales")
        out_f, in_f = weight.shape
        return weight.detach().float().reshape(out_f, in_f // self.group_size, self.group_size)


@dataclasses.dataclass(frozen=True)
class FixedBlockFormat(ScalarCodebookFormat):
    """A ggml-style format with one setting-free config: its name is its kind, its group a block."""

    block: ClassVar[int] = 32
    # ggml's q4_0 / q8_0 reference quantizers encode with the unrounded fp32 scale and store its fp16
    # rounding; keeping that order makes the data-free codes those of a GGUF block.
    encodes_with_unrounded_scale: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.kind

    def quantize(self, weight: Tensor, importance: Optional[Tensor] = None) -> dict[str, Tensor]:
        if importance is not None or not self.encodes_with_unrounded_scale:
            return super().quantize(weight, importance)
        x = self._groups(weight)
        d, mn = self.fit_groups(x)
        q = {"codes": self.encode(x, d, mn).reshape(weight.shape), "scales": d.reshape(weight.shape[0], -1).half()}
        if mn is not None:
            q["mins"] = mn.reshape(weight.shape[0], -1).half()
        return q

    @property
    def group_size(self) -> int:
        return self.block
