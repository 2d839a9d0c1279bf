"""Scalar-codebook group formats: each weight is a small code whose value is table[code] * scale
(+ min), with one fp16 scale (and min) per group of consecutive input features.

Uniform INT formats (table = integers), q4_0 (table = -8..7) and non-uniform tables (IQ4_NL, NUQ)
are all this family, so one reference dequantizer serves them and one kernel family (lut4) runs
every 4-bit member: the format hands the kernel its table, the kernel never re-derives the format.
"""
from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from .base import Format

FP16_MAX = 65504.0


@dataclasses.dataclass(frozen=True)
class ScalarCodebookFormat(Format):
    code_bits: ClassVar[int] = 4
    has_mins: ClassVar[bool] = False

    @abstractmethod
    def code_values(self) -> Tensor:
        """fp32 [2**code_bits]: the value each code stands for, before scaling."""

    def bits_per_weight(self) -> float:
        params = 16 * (2 if self.has_mins else 1)
        return self.code_bits + params / self.group_size

    def dequantize(self, q: dict[str, Tensor]) -> Tensor:
        codes, scales = q["codes"], q["scales"]
        table = self.code_values().to(codes.device)
        w = table[codes.long()] * scales.float().repeat_interleave(self.group_size, dim=1)
        if self.has_mins:
            w = w + q["mins"].float().repeat_interleave(self.group_size, dim=1)
        return w

    def _groups(self, weight: Tensor) -> Tensor:
        """[out, in] -> fp32 [out, in/group, group], after the format's input checks."""
        self.check_weight(weight)
        if float(weight.detach().abs().max()) > FP16_MAX / 2:
            raise ValueError(f"{self.name}: |weight| exceeds the fp16 range of the group scales; "
                             "rescale the layer or use a format with fp32 scales")
        out_f, in_f = weight.shape
        return weight.detach().float().reshape(out_f, in_f // self.group_size, self.group_size)
