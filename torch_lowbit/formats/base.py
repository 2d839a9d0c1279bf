"""What every weight format is: a frozen config that quantizes a float matrix into codes and group
parameters (pure torch) and holds the one reference dequantizer that every kernel is tested against.

A format knows nothing about packing or kernels: layouts (torch_lowbit/layouts) pack its output per
backend, and kernels read the packed buffers.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import ClassVar, Optional

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Format(ABC):
    """Base of all format configs. Subclasses are frozen dataclasses whose fields are the settings."""

    kind: ClassVar[str]  # family-level name used in checkpoints, e.g. "int4"
    version: ClassVar[int] = 1  # bump when quantize/dequantize semantics change
    layout_family: ClassVar[str]  # which layouts/kernels can run it, e.g. "lut4"

    @property
    @abstractmethod
    def name(self) -> str:
        """Registry name, e.g. "int4_g128"."""

    @property
    @abstractmethod
    def group_size(self) -> int:
        """Number of consecutive input features sharing one set of group parameters."""

    @abstractmethod
    def bits_per_weight(self) -> float:
        """Storage cost per weight, counting codes and every group parameter."""

    def storage_bits(self, out_features: int, in_features: int) -> float:
        """Bits an [out_features, in_features] layer takes: bits_per_weight() times its weights, unless
        a format stores per-layer tables whose cost depends on the shape (gvq's codebooks)."""
        return self.bits_per_weight() * out_features * in_features

    @abstractmethod
    def quantize(self, weight: Tensor, importance: Optional[Tensor] = None) -> dict[str, Tensor]:
        """Quantize a float [out, in] weight into named tensors (unpacked codes, group parameters).
        importance [in]: optional per-input-feature weights of the error (calibration statistics)."""

    @abstractmethod
    def dequantize(self, q: dict[str, Tensor]) -> Tensor:
        """The reference dequantizer: the fp32 [out, in] weight the codes stand for."""

    def for_layer(self, in_features: int) -> "Format":
        """The config a layer of `in_features` inputs is quantized with: itself for formats of a fixed
        group; per-channel formats (int4_pc) bind their group to the layer's whole row here."""
        return self

    def check_weight(self, weight: Tensor, what: str = "weight") -> None:
        """Rejects what the format cannot represent, naming the fix."""
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise ValueError(f"{self.name}: {what} must be a 2-D [out_features, in_features] tensor, "
                             f"got {type(weight).__name__} of shape {tuple(getattr(weight, 'shape', ()))}")
        if not weight.is_floating_point():
            raise TypeError(f"{self.name}: {what} must be floating point, got {weight.dtype}")
        if weight.device.type == "meta":
            raise ValueError(f"{self.name}: {what} is on the meta device; load real weights before quantizing "
                             "(or use torch_lowbit.load_quantized for a saved checkpoint)")
        problem = self.shape_problem(*weight.shape)
        if problem:
            raise ValueError(f"{self.name}: {what} {problem}")
        if not bool(torch.isfinite(weight).all()):
            bad = int((~torch.isfinite(weight)).sum())
            raise ValueError(f"{self.name}: {what} has {bad} NaN/Inf values; fix the checkpoint or the layer "
                             "before quantizing (quantizing them would silently produce garbage)")

    def shape_problem(self, out_features: int, in_features: int) -> Optional[str]:
        """Why a weight of this shape cannot be held (with the fix), or None if it can."""
        if in_features % self.group_size != 0:
            return (f"has in_features={in_features}, not divisible by the group size {self.group_size}; pick a "
                    f"format with a group size dividing {in_features} (e.g. a smaller group) or exclude this "
                    "layer with filter_fn")
        return None

    def check_quantized(self, q: dict[str, Tensor], out_features: int, in_features: int, *,
                        codes_as_row_bytes: bool = False) -> None:
        """Rejects already-quantized tensors (as quantize() returns them, e.g. read from a GGUF file)
        that this format cannot hold for an [out_features, in_features] weight, naming the fix. The
        base checks the shape and that q is a dict of tensors; formats add their tensors' shapes.
        codes_as_row_bytes: q["codes"] holds each row's codes as bytes (core.packing.row_bytes), which
        only 4- and 8-bit scalar-codebook formats have."""
        if codes_as_row_bytes:
            raise ValueError(f"{self.name}: its codes have no row-byte form; pass one code per byte")
        problem = self.shape_problem(out_features, in_features)
        if problem:
            raise ValueError(f"{self.name}: a weight of {out_features}x{in_features} {problem}")
        if not isinstance(q, dict) or not q or not all(isinstance(t, Tensor) for t in q.values()):
            raise TypeError(f"{self.name}: quantized tensors must be a non-empty dict of tensors as "
                            f"{type(self).__name__}.quantize() returns, got {type(q).__name__}")

    def to_json(self) -> dict:
        return {"kind": self.kind, "version": self.version, "params": dataclasses.asdict(self)}

    def __str__(self) -> str:
        return self.name
