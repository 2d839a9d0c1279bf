"""Uniform integer group formats: q4_0, q5_0 (ggml, symmetric), q5_1 (ggml, asymmetric), int{4,3,2}_g{32,64,128} (asymmetric) and the
symmetric int1_g* (±1 times a group scale) and int{2,3}_sym_g*."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import torch
from torch import Tensor

from .registry import register_format
from .scalar import FixedBlockFormat, ScalarCodebookFormat


@dataclasses.dataclass(frozen=True)
class _SignedBlock(FixedBlockFormat):
    """ggml's symmetric 32-weight blocks (Q4_0, Q5_0): value = (q - half) * d, q in 0 .. 2 half - 1, with
    quantize_row_q{4,5}_0_ref's rule: d = (signed value of largest magnitude) / -half, q = min(2 half - 1,
    trunc(x / d + half + 0.5)) in fp32 with the unrounded d, the fp16-rounded d stored."""

    half: ClassVar[int]
    encodes_with_unrounded_scale: ClassVar[bool] = True

    def code_values(self) -> Tensor:
        return torch.arange(2 * self.half, dtype=torch.float32) - self.half

    def fit_groups(self, x: Tensor, importance: Optional[Tensor] = None) -> tuple[Tensor, None]:
        idx = x.abs().argmax(dim=-1, keepdim=True)  # first of ties, as ggml's strict '<' scan
        signed_max = x.gather(-1, idx)
        if importance is None:
            return signed_max / -float(self.half), None
        return _weighted_symmetric_scale(x, importance, signed_max, half=self.half), None

    def encode(self, x: Tensor, scale: Tensor, mn: None = None) -> Tensor:
        inv_d = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
        return torch.trunc(x * inv_d + (self.half + 0.5)).clamp_(0, 2 * self.half - 1).to(torch.uint8)


@dataclasses.dataclass(frozen=True)
class Q4_0(_SignedBlock):
    """ggml Q4_0: blocks of 32, one fp16 scale d, value = (q - 8) * d.

    Quantization follows ggml's quantize_row_q4_0_ref step by step: d = (signed value of largest
    magnitude) / -8, q = min(15, trunc(x / d + 8.5)) computed in fp32 with the unrounded d, and the
    fp16-rounded d stored. Codes and scales are therefore those of a GGUF Q4_0 block (ggml builds
    that contract x*id + 8.5 into an FMA can differ by one code in rare ties).
    """

    kind: ClassVar[str] = "q4_0"
    half: ClassVar[int] = 8


@dataclasses.dataclass(frozen=True)
class Q5_0(_SignedBlock):
    """ggml Q5_0: blocks of 32, one fp16 scale d, value = (q - 16) * d, q in 0..31.

    Quantization follows ggml's quantize_row_q5_0_ref as Q4_0 follows q4_0's: d = (signed value of
    largest magnitude) / -16, q = min(31, trunc(x / d + 16.5)) in fp32 with the unrounded d, the
    fp16-rounded d stored.
    """

    kind: ClassVar[str] = "q5_0"
    code_bits: ClassVar[int] = 5
    half: ClassVar[int] = 16


@dataclasses.dataclass(frozen=True)
class Q5_1(FixedBlockFormat):
    """ggml Q5_1: blocks of 32, fp16 scale d and fp16 min m, value = q * d + m, q in 0..31.

    Data-free quantization follows ggml's quantize_row_q5_1_ref: d = (max - min) / 31, m = min,
    q = trunc((x - min) / d + 0.5) in fp32 with the unrounded d and m, their fp16 roundings stored.
    With importance, (d, m) are refit by weighted least squares from there (as int4_g32 does).
    """

    kind: ClassVar[str] = "q5_1"
    code_bits: ClassVar[int] = 5
    has_mins: ClassVar[bool] = True
    encodes_with_unrounded_scale: ClassVar[bool] = True

    def code_values(self) -> Tensor:
        return torch.arange(32, dtype=torch.float32)

    def fit_groups(self, x: Tensor, importance: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        scale, mn = minmax_params(x, 5)
        if importance is None:
            return scale, mn
        return _refine_affine(x, importance.expand_as(x), scale, mn, 4, 31)

    def encode(self, x: Tensor, scale: Tensor, mn: Tensor) -> Tensor:
        inv_d = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
        # ggml casts (x - min) * id + 0.5 >= 0 to uint8; the clamp only guards refit (d, m) pairs
        return torch.trunc((x - mn) * inv_d + 0.5).clamp_(0, 31).to(torch.uint8)


@dataclasses.dataclass(frozen=True)
class IntGroupFormat(ScalarCodebookFormat):
    """An integer grid of b-bit codes with one fp16 scale (and min) per group of `group` features."""

    bits: int = 4
    group: int = 128
    allowed_bits: ClassVar[tuple[int, ...]] = (1, 2, 3, 4)

    def __post_init__(self):
        if self.bits not in self.allowed_bits:
            raise ValueError(f"{self.kind}: bits must be {', '.join(map(str, self.allowed_bits[:-1]))} or "
                             f"{self.allowed_bits[-1]}, got {self.bits}")
        if self.group <= 0 or self.group % 32:
            raise ValueError(f"{self.kind}: group must be a positive multiple of 32, got {self.group}")

    @property
    def code_bits(self) -> int:
        return self.bits

    @property
    def group_size(self) -> int:
        return self.group


@dataclasses.dataclass(frozen=True)
class IntAsym(IntGroupFormat):
    """Asymmetric b-bit (b = 1..4): value = q * scale + min, q in 0..2^b - 1, fp16 scale and min per group.

    rounding="minmax" spans each group's [min, max]; "lsq" (default) starts there and alternates
    nearest-code assignment with a least-squares refit of (scale, min), keeping a group's refit only
    when it lowers that group's squared error, so it is never worse than minmax (tests check this).
    """

    kind: ClassVar[str] = "int_asym"
    has_mins: ClassVar[bool] = True
    rounding: str = "lsq"
    lsq_iters: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.rounding not in ("minmax", "lsq"):
            raise ValueError(f"{self.kind}: rounding must be 'minmax' or 'lsq', got {self.rounding!r}")

    @property
    def name(self) -> str:
        base = f"int{self.bits}_asym_g{self.group}" if self.bits == 1 else f"int{self.bits}_g{self.group}"
        return base if self.rounding == "lsq" else f"{base}_{self.rounding}"

    def code_values(self) -> Tensor:
        return torch.arange(2 ** self.bits, dtype=torch.float32)

    def fit_groups(self, x: Tensor, importance: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        top = 2 ** self.bits - 1
        scale, mn = minmax_params(x, self.bits)
        if self.rounding == "lsq" or importance is not None:
            w = torch.ones_like(x) if importance is None else importance.expand_as(x)
            scale, mn = _refine_affine(x, w, scale, mn, self.lsq_iters, top)
        return scale, mn

    def encode(self, x: Tensor, scale: Tensor, mn: Tensor) -> Tensor:
        return nearest_affine_codes(x, scale, mn, 2 ** self.bits - 1)


@dataclasses.dataclass(frozen=True)
class Int4(IntAsym):
    """int4_g*: IntAsym at 4 bits (its own checkpoint kind, as saved before other widths existed)."""

    kind: ClassVar[str] = "int4"

    def __post_init__(self):
        if self.bits != 4:
            raise ValueError(f"int4: bits must be 4, got {self.bits}; use IntAsym for other widths")
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class IntSym(IntGroupFormat):
    """Symmetric b-bit (b = 1..3): value = t * scale with t the odd integers -(2^b - 1) .. 2^b - 1
    (b = 1: ±1, the sign times the group scale; b = 2: ±1, ±3), one fp16 scale per group, no min.

    Levels are symmetric around zero without a zero level (as BitNet-style ±1 and QuIP#'s E8-free
    scalar grids): b bits buy 2^b levels where an asymmetric code spends one on its offset's range.
    Scale: absmax / (2^b - 1), then alternating nearest-level assignment and least-squares refit
    (d = Σ t x / Σ t²), a group's refit kept only when it lowers its squared error; at b = 1 the
    first refit is already optimal: d = mean |x|.
    """

    kind: ClassVar[str] = "int_sym"
    allowed_bits: ClassVar[tuple[int, ...]] = (1, 2, 3)
    bits: int = 1
    group: int = 64
    lsq_iters: int = 4

    @property
    def name(self) -> str:
        return f"int1_g{self.group}" if self.bits == 1 else f"int{self.bits}_sym_g{self.group}"

    def code_values(self) -> Tensor:
        return 2 * torch.arange(2 ** self.bits, dtype=torch.float32) - (2 ** self.bits - 1)

    def fit_groups(self, x: Tensor, importance: Optional[Tensor] = None) -> tuple[Tensor, None]:
        start = x.abs().amax(-1, keepdim=True) / self.code_values()[-1]
        if importance is None:
            return self._refit(x, torch.ones_like(x), start)[0], None
        # The weighted alternation can stall in a worse local optimum than the plain one: start it
        # from both and keep, per group, the scale of lower weighted error.
        w = importance.expand_as(x)
        scale, err = self._refit(x, w, start)
        plain_scale = self._refit(x, torch.ones_like(x), start)[0]
        plain_scale, plain_err = self._refit(x, w, plain_scale)
        return torch.where(plain_err < err, plain_scale, scale), None

    def _refit(self, x: Tensor, w: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
        """Alternate nearest levels and the weighted least-squares scale from `scale`, keeping only
        improvements: (scale, weighted squared error) per group."""
        values = self.code_values().to(x.device)

        def err_and_levels(d):
            t = values[self.encode(x, d, None).long()]
            return (w * (t * d - x) ** 2).sum(-1, keepdim=True), t

        err, t = err_and_levels(scale)
        for _ in range(self.lsq_iters):
            wtt = (w * t * t).sum(-1, keepdim=True)
            refit = torch.where(wtt > 0, (w * t * x).sum(-1, keepdim=True) / wtt.clamp_min(1e-30), scale)
            new_err, new_t = err_and_levels(refit)
            better = (refit > 0) & (new_err < err)
            scale, err = torch.where(better, refit, scale), torch.where(better, new_err, err)
            t = torch.where(better, new_t, t)
        return scale, err


@dataclasses.dataclass(frozen=True)
class Int4PerChannel(ScalarCodebookFormat):
    """int4_pc: QuaRot's per-channel symmetric int4, value = (q - 8) * scale with one fp16 scale per
    output row (q4_0's -8..7 grid; the group is the layer's whole row).

    The registered config is unbound (group 0); `for_layer(K)` gives the config of a layer with K
    inputs (group K), which is what a QuantLinear holds and a checkpoint records. The scale is the
    clipping search QuaRot runs for its weights: the candidate of least (importance-weighted)
    squared error among divisors of the row's signed max (ggml's -8 among them), each also refit by
    least squares. With per-token activations a whole row is one int32 dot product in the CPU
    kernels (csrc/common/lut_i8.h), the W4A8 / W4A4 fast path.
    """

    kind: ClassVar[str] = "int4_pc"
    group: int = 0  # 0: not bound to a layer yet

    def __post_init__(self):
        if self.group < 0 or self.group % 32:
            raise ValueError(f"int4_pc: group must be 0 (unbound) or the layer's in_features, a multiple of 32; "
                             f"got {self.group}")

    @property
    def name(self) -> str:
        return "int4_pc"

    @property
    def group_size(self) -> int:
        # unbound: the multiple a layer's in_features must be (what shape checks and tests ask of it);
        # everything that rounds or packs runs on the bound config
        return self.group or 32

    def for_layer(self, in_features: int) -> "Int4PerChannel":
        if self.group and self.group != in_features:
            raise ValueError(f"int4_pc: this config is bound to rows of {self.group} features, the layer has "
                             f"{in_features}; use the format name 'int4_pc'")
        if in_features <= 0 or in_features % 32:
            raise ValueError(f"int4_pc: in_features must be a positive multiple of 32 (int8 activation blocks), "
                             f"got {in_features}; exclude this layer with filter_fn")
        return dataclasses.replace(self, group=in_features)

    def shape_problem(self, out_features: int, in_features: int) -> Optional[str]:
        if in_features % 32 or (self.group and in_features != self.group):
            return (f"has in_features={in_features}; int4_pc needs a multiple of 32 and a config bound to it "
                    "(format name 'int4_pc'); or exclude this layer with filter_fn")
        return None

    # Unbound, the config binds itself to the tensors it is handed.
    def quantize(self, weight: Tensor, importance: Optional[Tensor] = None) -> dict[str, Tensor]:
        if not self.group and isinstance(weight, Tensor) and weight.dim() == 2:
            return self.for_layer(weight.shape[1]).quantize(weight, importance)
        return super().quantize(weight, importance)

    def dequantize(self, q: dict[str, Tensor]) -> Tensor:
        return super(Int4PerChannel, self.for_layer(q["codes"].shape[1])).dequantize(q)

    def check_quantized(self, q: dict[str, Tensor], out_features: int, in_features: int, *,
                        codes_as_row_bytes: bool = False) -> None:
        super(Int4PerChannel, self.for_layer(in_features)).check_quantized(q, out_features, in_features,
                                                                           codes_as_row_bytes=codes_as_row_bytes)

    def bits_per_weight(self) -> float:
        return 4 + 16 / (self.group or 4096)  # one fp16 per row (counted at 4096 inputs while unbound)

    def code_values(self) -> Tensor:
        return torch.arange(16, dtype=torch.float32) - 8

    def fit_groups(self, x: Tensor, importance: Optional[Tensor] = None) -> tuple[Tensor, None]:
        signed_max = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))
        w = torch.ones_like(x) if importance is None else importance
        return _weighted_symmetric_scale(x, w, signed_max), None


def minmax_params(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Asymmetric min/max rounding of groups x [..., g]: fp32 (scale, min) [..., 1] spanning each group's
    [min, max] with 2^bits levels (IntAsym's start and its "minmax" rule; the KV cache's rule)."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    return (hi - lo) / (2 ** bits - 1), lo


def nearest_affine_codes(x: Tensor, scale: Tensor, mn: Tensor, top: int) -> Tensor:
    """uint8 codes round((x - mn) / scale) clamped to 0..top (code 0 where the scale is 0)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round((x - mn) / safe).clamp_(0, top).to(torch.uint8)


def _sq_err(x: Tensor, w: Tensor, scale: Tensor, mn: Tensor, top: int) -> Tensor:
    return (w * (nearest_affine_codes(x, scale, mn, top).float() * scale + mn - x) ** 2).sum(-1, keepdim=True)


def _refine_affine(x: Tensor, w: Tensor, scale: Tensor, mn: Tensor, iters: int, top: int) -> tuple[Tensor, Tensor]:
    """Alternating (weighted) least squares for x ≈ scale * q + mn per group, keeping only
    improvements, so the result is never worse than the starting point."""
    n = w.sum(-1, keepdim=True)
    err = _sq_err(x, w, scale, mn, top)
    for _ in range(iters):
        q = nearest_affine_codes(x, scale, mn, top).float()
        sq, sqq = (w * q).sum(-1, keepdim=True), (w * q * q).sum(-1, keepdim=True)
        sx, sqx = (w * x).sum(-1, keepdim=True), (w * q * x).sum(-1, keepdim=True)
        det = n * sqq - sq * sq
        ok = det > 1e-12 * n * sqq
        new_scale = torch.where(ok, (n * sqx - sq * sx) / torch.where(ok, det, torch.ones_like(det)), scale)
        new_mn = torch.where(ok, (sx - new_scale * sq) / n, mn)
        ok &= new_scale > 0
        new_err = _sq_err(x, w, new_scale, new_mn, top)
        better = ok & (new_err < err)
        scale, mn = torch.where(better, new_scale, scale), torch.where(better, new_mn, mn)
        err = torch.where(better, new_err, err)
    return scale, mn


def _weighted_symmetric_scale(x: Tensor, w: Tensor, signed_max: Tensor, half: int = 8) -> Tensor:
    """Scale d minimizing sum w (x - d * clamp(round(x / d), -half, half - 1))^2 per group (q4_0: half = 8,
    q5_0: 16): a grid of candidate divisors of the signed max (ggml's own choice, -half, among them;
    positive divisors put the largest magnitude on the half - 1 side), each also refit by weighted least squares on its codes
    (llama.cpp's make_qx_quants search, importance-weighted)."""
    w = w.expand_as(x)
    best_err, best = None, None
    unit = half / 8  # the q4_0 grid, stretched
    divisors = [v * unit for v in torch.linspace(-9.5, -6.0, 36).tolist() + [-8.0] + torch.linspace(5.5, 7.5, 11).tolist()]
    for divisor in divisors:
        d = signed_max / divisor
        q = torch.round(x / torch.where(d != 0, d, torch.ones_like(d))).clamp_(-half, half - 1)
        wqq = (w * q * q).sum(-1, keepdim=True)
        refit = torch.where(wqq > 0, (w * q * x).sum(-1, keepdim=True) / wqq.clamp_min(1e-30), d)
        for cand in (d, refit):
            c16 = cand.half().float()  # judge the scale that will be stored
            qc = torch.round(x / torch.where(c16 != 0, c16, torch.ones_like(c16))).clamp_(-half, half - 1)
            err = (w * (qc * c16 - x) ** 2).sum(-1, keepdim=True)
            if best is None:
                best_err, best = err, c16
            else:
                better = err < best_err
                best_err, best = torch.where(better, err, best_err), torch.where(better, c16, best)
    return best


register_format(Q4_0())
GGML_Q5 = {f.name: register_format(f) for f in (Q5_0(), Q5_1())}  # CPU: the lut5_i8_n16 tiles
register_format(Int4PerChannel())
for _g in (32, 64, 128):
    register_format(Int4(group=_g))
    for _b in (3, 2):
        register_format(IntAsym(bits=_b, group=_g))
    register_format(Int4(group=_g, rounding="minmax"))
    for _b in (1, 2):
        register_format(IntSym(bits=_b, group=_g))
