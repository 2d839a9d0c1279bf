"""Uniform integer group formats: q4_0 (ggml, symmetric) and int4_g{32,64,128} (asymmetric)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from .registry import register_format
from .scalar import ScalarCodebookFormat


@dataclasses.dataclass(frozen=True)
class Q4_0(ScalarCodebookFormat):
    """ggml Q4_0: blocks of 32, one fp16 scale d, value = (q - 8) * d.

    Quantization follows ggml's quantize_row_q4_0_ref step by step: d = (signed value of largest
    magnitude) / -8, q = min(15, trunc(x / d + 8.5)) computed in fp32 with the unrounded d, and the
    fp16-rounded d stored. Codes and scales are therefore those of a GGUF Q4_0 block (ggml builds
    that contract x*id + 8.5 into an FMA can differ by one code in rare ties).
    """

    kind: ClassVar[str] = "q4_0"
    layout_family: ClassVar[str] = "lut4"

    @property
    def name(self) -> str:
        return "q4_0"

    @property
    def group_size(self) -> int:
        return 32

    def code_values(self) -> Tensor:
        return torch.arange(16, dtype=torch.float32) - 8

    def quantize(self, weight: Tensor) -> dict[str, Tensor]:
        x = self._groups(weight)
        idx = x.abs().argmax(dim=-1, keepdim=True)  # first of ties, as ggml's strict '<' scan
        d = x.gather(-1, idx) / -8.0
        inv_d = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        codes = torch.trunc(x * inv_d + 8.5).clamp_(max=15)
        return {"codes": codes.to(torch.uint8).reshape(weight.shape), "scales": d.squeeze(-1).half()}


@dataclasses.dataclass(frozen=True)
class Int4(ScalarCodebookFormat):
    """Asymmetric 4-bit: value = q * scale + min, q in 0..15, fp16 scale and min per group.

    rounding="minmax" spans each group's [min, max]; "lsq" (default) starts there and alternates
    nearest-code assignment with a least-squares refit of (scale, min), keeping a group's refit only
    when it lowers that group's squared error, so it is never worse than minmax (tests check this).
    """

    kind: ClassVar[str] = "int4"
    layout_family: ClassVar[str] = "lut4"
    has_mins: ClassVar[bool] = True
    group: int = 128
    rounding: str = "lsq"
    lsq_iters: int = 4

    def __post_init__(self):
        if self.group <= 0 or self.group % 32:
            raise ValueError(f"int4: group must be a positive multiple of 32, got {self.group}")
        if self.rounding not in ("minmax", "lsq"):
            raise ValueError(f"int4: rounding must be 'minmax' or 'lsq', got {self.rounding!r}")

    @property
    def name(self) -> str:
        base = f"int4_g{self.group}"
        return base if self.rounding == "lsq" else f"{base}_{self.rounding}"

    @property
    def group_size(self) -> int:
        return self.group

    def code_values(self) -> Tensor:
        return torch.arange(16, dtype=torch.float32)

    def quantize(self, weight: Tensor) -> dict[str, Tensor]:
        x = self._groups(weight)
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        scale, mn = (hi - lo) / 15.0, lo
        if self.rounding == "lsq":
            scale, mn = _refine_affine(x, scale, mn, self.lsq_iters)
        scale16, mn16 = scale.half(), mn.half()
        codes = _nearest_codes(x, scale16.float(), mn16.float())
        return {"codes": codes.reshape(weight.shape), "scales": scale16.squeeze(-1),
                "mins": mn16.squeeze(-1)}


def _nearest_codes(x: Tensor, scale: Tensor, mn: Tensor) -> Tensor:
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round((x - mn) / safe).clamp_(0, 15).to(torch.uint8)


def _sq_err(x: Tensor, scale: Tensor, mn: Tensor) -> Tensor:
    return ((_nearest_codes(x, scale, mn).float() * scale + mn - x) ** 2).sum(-1, keepdim=True)


def _refine_affine(x: Tensor, scale: Tensor, mn: Tensor, iters: int) -> tuple[Tensor, Tensor]:
    """Alternating least squares for x ≈ scale * q + mn per group (keeps only improvements)."""
    n = x.shape[-1]
    err = _sq_err(x, scale, mn)
    for _ in range(iters):
        q = _nearest_codes(x, scale, mn).float()
        sq, sqq = q.sum(-1, keepdim=True), (q * q).sum(-1, keepdim=True)
        sx, sqx = x.sum(-1, keepdim=True), (q * x).sum(-1, keepdim=True)
        det = n * sqq - sq * sq
        ok = det > 0
        new_scale = torch.where(ok, (n * sqx - sq * sx) / torch.where(ok, det, torch.ones_like(det)), scale)
        new_mn = torch.where(ok, (sx - new_scale * sq) / n, mn)
        ok &= new_scale > 0
        new_err = _sq_err(x, new_scale, new_mn)
        better = ok & (new_err < err)
        scale, mn = torch.where(better, new_scale, scale), torch.where(better, new_mn, mn)
        err = torch.where(better, new_err, err)
    return scale, mn


register_format(Q4_0())
for _g in (32, 64, 128):
    register_format(Int4(group=_g))
    register_format(Int4(group=_g, rounding="minmax"))
