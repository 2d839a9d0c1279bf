"""ggml's K-quants q2_k, q3_k, q4_k, q5_k, q6_k: super-blocks of 256 weights with two-level scales.

Each super-block holds an fp16 d (and dmin) and small integer scales (and mins) for its sub-blocks
of 16 or 32 weights; a weight is its sub-block's integer scale times d times its code:

| format | code bits | sub-block | sub-scale (sub-min)         | value                                   | bits/weight |
|--------|-----------|-----------|-----------------------------|-----------------------------------------|-------------|
| q2_k   | 2         | 16        | 0..15 (0..15)               | d*scale * code - dmin*min               | 2.625       |
| q3_k   | 3         | 16        | signed -32..31              | d*scale * (code - 4)                    | 3.4375      |
| q4_k   | 4         | 32        | 0..63 (0..63)               | d*scale * code - dmin*min               | 4.5         |
| q5_k   | 5         | 32        | 0..63 (0..63)               | d*scale * code - dmin*min               | 5.5         |
| q6_k   | 6         | 16        | int8                        | d*scale * (code - 32)                   | 6.5625      |

The tensors are unpacked, one integer per byte: codes uint8 [N, K], sub_scales [N, K / sub-block]
(uint8; int8 for q3_k and q6_k), sub_mins uint8 (q2_k, q4_k, q5_k), d (and dmin) fp16 [N, K/256].
core/kquant_blocks.py converts them to and from GGUF block bytes losslessly. The reference
dequantizer computes in fp32 in ggml's order ((d * scale) * code - dmin * min), so it equals
ggml's / gguf's dequantizers bit for bit.

quantize follows ggml-quants.c: without importance quantize_row_q{2..6}_K_ref (make_qkx2_quants
for the affine types, make_q3_quants for q3_k, make_qx_quants for q6_k, then the super-block
scale quantization and re-encoding against the stored scales); with importance [in_features]
llama.cpp's imatrix path quantize_row_q*_K_impl (make_qkx3_quants, make_qp_quants, weighted
make_qx_quants). Vectorized over all sub-blocks of all rows, with C's arithmetic: fp32 sums added
left to right, correctly rounded sqrtf, ties to even, so the blocks are ggml's own (tests compare
loop-for-loop transcriptions of the C); a ggml build that contracts a*b + c into FMAs can differ in
rare ties, still a valid block.
"""
from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import ClassVar, Optional

import torch
from torch import Tensor

from ..core.kquant_blocks import BLOCK_BYTES, SUPER_BLOCK
from .base import Format
from .registry import register_format
from .scalar import FP16_MAX

GROUP_MAX_EPS = 1e-15  # ggml: a group whose largest magnitude is below this is all zeros


def _f32(v: float) -> Tensor:
    return torch.tensor(v, dtype=torch.float32)


def nearest_int(v: Tensor) -> Tensor:
    """ggml's nearest_int (the 1.5 * 2^23 trick): round half to even, as torch.round."""
    return torch.round(v)


def _safe(t: Tensor) -> Tensor:
    return torch.where(t != 0, t, torch.ones_like(t))


def sqrtf(t: Tensor) -> Tensor:
    """C's sqrtf, correctly rounded: torch's vectorized fp32 sqrt can be an ulp off; the fp64 root
    rounded to fp32 is exact (53 >= 2 * 24 + 2 bits)."""
    return t.double().sqrt().float()


def sequential_sum(t: Tensor, keepdim: bool = False) -> Tensor:
    """Sum over the last dim added left to right in fp32, as ggml's C loops: torch's pairwise sums
    round differently, and ggml's searches compare errors that differ by less than that."""
    acc = t[..., 0]
    for i in range(1, t.shape[-1]):
        acc = acc + t[..., i]
    return acc.unsqueeze(-1) if keepdim else acc


# ---- ggml's search helpers, over groups x [G, n] at once -----------------------------------------

def fit_affine(x: Tensor, w: Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
               use_mad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """ggml's make_qkx2_quants / make_qkx3_quants (the same search where weights are given):
    x ~ scale * L - the_min with L in 0..nmax, min clamped to <= 0, trying iscale = (rmin + rdelta*is
    + nmax) / (max - min) for is = 0..nstep, each refit by weighted least squares, keeping the lowest
    weighted error (absolute with use_mad, else squared). As in ggml, each step measures from the best
    min so far (it moves the offset and the span max - min). Returns (scale [G], the_min [G] >= 0, L)."""
    mn = x.amin(-1).clamp(max=0)
    mx = x.amax(-1)
    flat = mx == mn
    sum_w, sum_x = sequential_sum(w), sequential_sum(w * x)

    def error(scale, m, levels):
        diff = scale[:, None] * levels + m[:, None] - x
        return sequential_sum(w * (diff.abs() if use_mad else diff * diff))

    iscale = nmax / _safe(mx - mn)
    scale = 1 / iscale
    levels = nearest_int(iscale[:, None] * (x - mn[:, None])).clamp(0, nmax)
    best = error(scale, mn, levels)
    for step in range(nstep + 1):
        iscale = (_f32(rmin) + _f32(rdelta) * step + nmax) / (mx - mn)
        # make_qkx3_quants' guard (the best min can reach max): v <= 0 or NaN -> 0; the same levels as
        # make_qkx2_quants' clamp wherever that one is defined
        v = iscale[:, None] * (x - mn[:, None])
        cand = torch.where(v > 0, nearest_int(v.clamp(max=nmax)), torch.zeros_like(v))
        sum_l, sum_l2, sum_xl = sequential_sum(w * cand), sequential_sum(w * cand * cand), sequential_sum(w * cand * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / _safe(det)
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / _safe(det)
        positive = this_min > 0
        this_scale = torch.where(positive, sum_xl / _safe(sum_l2), this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        err = error(this_scale, this_min, cand)
        better = (det > 0) & (err < best)
        levels = torch.where(better[:, None], cand, levels)
        best = torch.where(better, err, best)
        scale = torch.where(better, this_scale, scale)
        mn = torch.where(better, this_min, mn)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    levels = torch.where(flat[:, None], torch.zeros_like(levels), levels)
    return scale, -mn, levels


def _signed_max(x: Tensor) -> tuple[Tensor, Tensor]:
    """(the value of largest magnitude, first of ties as ggml's strict '>' scan; that magnitude)."""
    idx = x.abs().argmax(-1, keepdim=True)
    signed = x.gather(-1, idx)[:, 0]
    return signed, signed.abs()


def fit_symmetric(x: Tensor, nmax: int, w: Tensor) -> tuple[Tensor, Tensor]:
    """ggml's make_qx_quants (rmse_type 1, weights w): x ~ scale * l, l in -nmax..nmax-1, starting
    from iscale = -nmax / max and trying -(nmax + 0.1 is) / max, is = -9..9, each refit by weighted
    least squares, keeping the best sum(w x l)^2 / sum(w l^2). Returns (scale [G], L = l + nmax)."""
    signed, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    smax = _safe(signed)

    def levels_for(iscale):
        return nearest_int(iscale[:, None] * x).clamp(-nmax, nmax - 1)

    levels = levels_for(-nmax / smax)
    sumlx, suml2 = sequential_sum(w * x * levels), sequential_sum(w * levels * levels)
    scale = torch.where(suml2 != 0, sumlx / _safe(suml2), torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        cand = levels_for(-(nmax + _f32(0.1) * step) / smax)
        sumlx, suml2 = sequential_sum(w * x * cand), sequential_sum(w * cand * cand)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = torch.where(better[:, None], cand, levels)
        scale = torch.where(better, sumlx / _safe(suml2), scale)
        best = torch.where(better, scale * sumlx, best)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    levels = torch.where(zero[:, None], torch.full_like(levels, -nmax), levels)  # ggml's L = 0
    return scale, levels + nmax


def _coordinate_refine(x: Tensor, w: Tensor, levels: Tensor, lo: Optional[int], hi: int,
                       require_positive_l2: bool) -> tuple[Tensor, Tensor, Tensor]:
    """ggml's 5 sweeps of single-level changes that raise sum(w x l)^2 / sum(w l^2), element by element
    in order (as make_q3_quants and make_qp_quants). Returns (levels, sumlx, suml2)."""
    levels = levels.clone()
    sumlx, suml2 = sequential_sum(w * x * levels), sequential_sum(w * levels * levels)
    for _ in range(5):  # ggml stops once a sweep changes nothing; a further sweep then changes nothing too
        for i in range(x.shape[-1]):
            xi, wi, li = x[:, i], w[:, i], levels[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0) if require_positive_l2 else slx > 0
            new = nearest_int(xi * sl2 / _safe(slx)).clamp(lo, hi) if lo is not None else \
                nearest_int(xi * sl2 / _safe(slx)).clamp(max=hi)
            ok &= new != li
            slx = slx + wi * xi * new
            sl2 = sl2 + wi * new * new
            gain = slx * slx * suml2 > sumlx * sumlx * sl2
            if not require_positive_l2:
                gain &= sl2 > 0
            take = ok & gain
            levels[:, i] = torch.where(take, new, li)
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
    return levels, sumlx, suml2


def fit_q3(x: Tensor, nmax: int) -> tuple[Tensor, Tensor]:
    """ggml's make_q3_quants with do_rmse: levels from iscale = -nmax / max, then the coordinate
    sweeps with weights x^2. Returns (scale [G], L = l + nmax; 0 for an all-zero group)."""
    signed, amax = _signed_max(x)
    zero = amax < GROUP_MAX_EPS
    levels = nearest_int((-nmax / _safe(signed))[:, None] * x).clamp(-nmax, nmax - 1)
    levels, sumlx, suml2 = _coordinate_refine(x, x * x, levels, -nmax, nmax - 1, require_positive_l2=False)
    scale = torch.where(suml2 > 0, sumlx / _safe(suml2), torch.zeros_like(sumlx))
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, torch.where(zero[:, None], torch.zeros_like(levels), levels + nmax)


def fit_positive(x: Tensor, nmax: int, w: Tensor) -> tuple[Tensor, Tensor]:
    """ggml's make_qp_quants: non-negative x ~ scale * L, L in 0..nmax, weighted (the imatrix path's
    super-block scale). Returns (scale [G], L)."""
    mx = x.amax(-1).clamp(min=0)
    zero = mx < GROUP_MAX_EPS
    smx = _safe(mx)
    iscale = nmax / smx
    levels = nearest_int(iscale[:, None] * x)
    diff = x - (1 / iscale)[:, None] * levels
    best = sequential_sum(w * diff * diff)
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (_f32(0.1) * step + nmax) / smx
        cand = nearest_int(iscale_is[:, None] * x).clamp(max=nmax)
        diff = x - (1 / iscale_is)[:, None] * cand
        mse = sequential_sum(w * diff * diff)
        better = mse < best
        best = torch.where(better, mse, best)
        iscale = torch.where(better, iscale_is, iscale)
    levels = nearest_int(iscale[:, None] * x).clamp(max=nmax)
    levels, sumlx, suml2 = _coordinate_refine(x, w, levels, None, nmax, require_positive_l2=True)
    scale = torch.where(suml2 > 0, sumlx / _safe(suml2), torch.zeros_like(sumlx))
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, torch.where(zero[:, None], torch.zeros_like(levels), levels)


# ---- the formats ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KQuantFormat(Format):
    """A ggml K-quant: super-blocks of 256 weights, sub-blocks with integer scales (see the module)."""

    layout_family: ClassVar[str] = "ggml_k"
    code_bits: ClassVar[int]
    sub_block: ClassVar[int]  # weights per integer scale: 16 or 32
    has_mins: ClassVar[bool]
    code_offset: ClassVar[int] = 0  # symmetric types: value = d * scale * (code - offset)
    scale_dtype: ClassVar[torch.dtype] = torch.uint8
    scale_range: ClassVar[tuple[int, int]] = (0, 63)

    @property
    def name(self) -> str:
        return self.kind

    @property
    def group_size(self) -> int:
        return SUPER_BLOCK

    def bits_per_weight(self) -> float:
        return BLOCK_BYTES[self.kind] * 8 / SUPER_BLOCK

    def shape_problem(self, out_features: int, in_features: int) -> Optional[str]:
        if in_features % SUPER_BLOCK:
            return (f"has in_features={in_features}, not a multiple of {SUPER_BLOCK} (K-quant super-blocks); "
                    "use a format of smaller blocks for this layer where its width allows (q4_0, q8_0, iq4_nl: "
                    "multiples of 32) or exclude it with filter_fn")
        return None

    def _expected(self, out_features: int, in_features: int) -> dict[str, tuple[tuple, torch.dtype]]:
        subs = (out_features, in_features // self.sub_block)
        supers = (out_features, in_features // SUPER_BLOCK)
        expected = {"codes": ((out_features, in_features), torch.uint8), "sub_scales": (subs, self.scale_dtype),
                    "d": (supers, torch.float16)}
        if self.has_mins:
            expected.update(sub_mins=(subs, torch.uint8), dmin=(supers, torch.float16))
        return expected

    def check_quantized(self, q: dict[str, Tensor], out_features: int, in_features: int, *,
                        codes_as_row_bytes: bool = False) -> None:
        super().check_quantized(q, out_features, in_features, codes_as_row_bytes=codes_as_row_bytes)
        expected = self._expected(out_features, in_features)
        if set(q) != set(expected):
            raise ValueError(f"{self.name}: quantized tensors must be exactly {sorted(expected)}, got {sorted(q)}")
        for key, (shape, dtype) in expected.items():
            t = q[key]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{self.name}: {key} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
        ranges = {"codes": (0, (1 << self.code_bits) - 1), "sub_scales": self.scale_range}
        if self.has_mins:
            ranges["sub_mins"] = self.scale_range
        for key, (lo, hi) in ranges.items():
            t = q[key]
            if t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
                raise ValueError(f"{self.name}: {key} must lie in {lo}..{hi}, got {int(t.min())}..{int(t.max())}")
        if not all(bool(torch.isfinite(q[k]).all()) for k in ("d", "dmin") if k in q):
            raise ValueError(f"{self.name}: d/dmin hold NaN/Inf; fix the source tensors")

    def dequantize(self, q: dict[str, Tensor]) -> Tensor:
        """fp32 [N, K] in ggml's operation order: (d * scale) * code - dmin * min, or
        (d * scale) * (code - offset), each product rounded to fp32 (no fused multiply-add)."""
        codes = q["codes"]
        n, k = codes.shape
        per_super = SUPER_BLOCK // self.sub_block
        d = q["d"].float().repeat_interleave(per_super, dim=1)
        scale = (d * q["sub_scales"].float()).reshape(n, -1, 1)
        levels = codes.reshape(n, -1, self.sub_block).float()
        if self.has_mins:
            dmin = q["dmin"].float().repeat_interleave(per_super, dim=1)
            offset = (dmin * q["sub_mins"].float()).reshape(n, -1, 1)
            return (scale * levels - offset).reshape(n, k)
        return (scale * (levels - self.code_offset)).reshape(n, k)

    def quantize(self, weight: Tensor, importance: Optional[Tensor] = None) -> dict[str, Tensor]:
        """ggml's quantize_row_*_K_ref, or with importance [in_features] (calibration E[x^2] per input
        feature, llama.cpp's imatrix) quantize_row_*_K_impl."""
        self.check_weight(weight)
        if float(weight.detach().abs().max()) > FP16_MAX / 2:
            raise ValueError(f"{self.name}: |weight| exceeds the fp16 range of the super-block scales; "
                             "rescale the layer or use a format with fp32 scales")
        n, k = weight.shape
        x = weight.detach().float().reshape(n * k // SUPER_BLOCK, SUPER_BLOCK)  # one row per super-block
        imp = None if importance is None else self._importance(importance, k).to(x.device).repeat(n, 1)
        q = self._quantize_blocks(x, imp)
        return {key: t.reshape(n, -1) for key, t in q.items()}

    def fixed_parameters(self, weight: Tensor, importance: Optional[Tensor] = None) -> dict[str, Tensor]:
        """GPTQ's parameters, fixed before its column sweep: the super-block d (dmin) and the sub-block
        scales (mins) this format's quantizer picks for the original weight (with importance: llama.cpp's
        imatrix path)."""
        return {k: v for k, v in self.quantize(weight, importance).items() if k != "codes"}

    def encode_column(self, fixed: dict[str, Tensor], col: int, x: Tensor) -> tuple[Tensor, Tensor]:
        """Column col's codes uint8 [N] for values x [N] under the fixed parameters, and the values they
        dequantize to (the dequantizer's arithmetic, so GPTQ feeds forward the exact error)."""
        sb, sub = col // SUPER_BLOCK, col // self.sub_block
        scale = fixed["d"][:, sb].float() * fixed["sub_scales"][:, sub].float()
        safe = torch.where(scale != 0, scale, torch.ones_like(scale))
        top = (1 << self.code_bits) - 1
        if self.has_mins:
            low = fixed["dmin"][:, sb].float() * fixed["sub_mins"][:, sub].float()
            codes = torch.where(scale != 0, torch.round((x + low) / safe), torch.zeros_like(x)).clamp(0, top)
            return codes.to(torch.uint8), scale * codes - low
        codes = (torch.where(scale != 0, torch.round(x / safe), torch.zeros_like(x)) + self.code_offset).clamp(0, top)
        return codes.to(torch.uint8), scale * (codes - self.code_offset)

    def _importance(self, importance: Tensor, in_features: int) -> Tensor:
        if not isinstance(importance, Tensor) or importance.shape != (in_features,) or \
                not bool(torch.isfinite(importance).all()) or bool((importance < 0).any()):
            raise ValueError(f"{self.name}: importance must be {in_features} finite non-negative values "
                             "(one per input feature)")
        # used as llama.cpp uses its imatrix (E[x^2] per input), so the same values give the same blocks
        return importance.detach().float().reshape(in_features // SUPER_BLOCK, SUPER_BLOCK)

    @abstractmethod
    def _quantize_blocks(self, x: Tensor, imp: Optional[Tensor]) -> dict[str, Tensor]:
        """x fp32 [B, 256] super-blocks, imp [B, 256] or None -> the tensors per super-block."""

    def _subs(self, x: Tensor) -> Tensor:
        return x.reshape(-1, self.sub_block)


def _sub_block_view(t: Tensor, blocks: int) -> Tensor:
    return t.reshape(blocks, -1)


@dataclasses.dataclass(frozen=True)
class _AffineK(KQuantFormat):
    """q2_k, q4_k, q5_k: value = d * scale * code - dmin * min."""

    has_mins: ClassVar[bool] = True
    # quantize_row_*_K_ref's make_qkx2_quants settings: (rmin, rdelta, nstep, use_mad)
    ref_search: ClassVar[tuple[float, float, int, bool]]
    sigma_factor: ClassVar[float] = 2.0  # imatrix path: sigma2 = factor * mean(x^2) of the super-block

    def _ref_weights(self, subs: Tensor) -> Tensor:
        """quantize_row_*_K_ref's weights (q4_k, q5_k): sqrt(mean x^2) of the sub-block + |x|."""
        return sqrtf(sequential_sum(subs * subs, keepdim=True) / self.sub_block) + subs.abs()

    def _quantize_blocks(self, x: Tensor, imp: Optional[Tensor]) -> dict[str, Tensor]:
        blocks = x.shape[0]
        subs = self._subs(x)
        nmax = (1 << self.code_bits) - 1
        top = self.scale_range[1]
        if imp is None:
            rmin, rdelta, nstep, use_mad = self.ref_search
            scales, mins, levels = fit_affine(subs, self._ref_weights(subs), nmax, rmin, rdelta, nstep, use_mad)
            scales, mins = _sub_block_view(scales, blocks), _sub_block_view(mins, blocks)
            max_scale = scales.amax(-1).clamp(min=0)
            max_min = mins.amax(-1).clamp(min=0)
            # ggml: integer scale round(top / max * s), d = max / top (0 when max is 0)
            inv_scale = torch.where(max_scale > 0, top / _safe(max_scale), torch.zeros_like(max_scale))
            inv_min = torch.where(max_min > 0, top / _safe(max_min), torch.zeros_like(max_min))
            sub_scales = nearest_int(inv_scale[:, None] * scales).clamp(0, top)
            sub_mins = nearest_int(inv_min[:, None] * mins).clamp(0, top)
            d, dmin = (max_scale / top).half(), (max_min / top).half()
        else:
            sq = sequential_sum(x * x, keepdim=True)
            sigma2 = self.sigma_factor * sq / SUPER_BLOCK
            w = imp * sqrtf(sigma2 + x * x)
            subs_w = self._subs(w)
            scales, mins, levels = fit_affine(subs, subs_w, nmax, -0.9, 0.05, 36, False)
            sub_w = _sub_block_view(sequential_sum(subs_w), blocks)
            d, sub_scales = fit_positive(_sub_block_view(scales, blocks), top, sub_w)
            dmin, sub_mins = fit_positive(_sub_block_view(mins, blocks), top, sub_w)
            d, dmin = d.half(), dmin.half()
            sub_scales, sub_mins = sub_scales.clamp(0, top), sub_mins.clamp(0, top)
        # re-encode every sub-block against its stored scale and min (ggml keeps the search's codes where
        # the stored scale is 0: they dequantize to -min either way)
        step = _sub_block_view(d.float()[:, None] * sub_scales, blocks).reshape(-1, 1)
        offset = (dmin.float()[:, None] * sub_mins).reshape(-1, 1)
        recoded = nearest_int((subs + offset) / _safe(step)).clamp(0, nmax)
        levels = torch.where(step != 0, recoded, levels)
        return {"codes": levels.reshape(blocks, SUPER_BLOCK).to(torch.uint8),
                "sub_scales": sub_scales.to(torch.uint8), "sub_mins": sub_mins.to(torch.uint8),
                "d": d, "dmin": dmin}


@dataclasses.dataclass(frozen=True)
class Q2_K(_AffineK):
    """ggml Q2_K: 2-bit codes, 4-bit scales and mins per 16 weights, fp16 d and dmin (84 bytes / 256)."""

    kind: ClassVar[str] = "q2_k"
    code_bits: ClassVar[int] = 2
    sub_block: ClassVar[int] = 16
    scale_range: ClassVar[tuple[int, int]] = (0, 15)
    ref_search: ClassVar[tuple] = (-0.5, 0.1, 15, True)
    sigma_factor: ClassVar[float] = 1.0

    def _ref_weights(self, subs: Tensor) -> Tensor:
        return subs.abs()


@dataclasses.dataclass(frozen=True)
class Q4_K(_AffineK):
    """ggml Q4_K: 4-bit codes, 6-bit scales and mins per 32 weights, fp16 d and dmin (144 bytes / 256)."""

    kind: ClassVar[str] = "q4_k"
    code_bits: ClassVar[int] = 4
    sub_block: ClassVar[int] = 32
    ref_search: ClassVar[tuple] = (-1.0, 0.1, 20, False)


@dataclasses.dataclass(frozen=True)
class Q5_K(_AffineK):
    """ggml Q5_K: 5-bit codes, 6-bit scales and mins per 32 weights, fp16 d and dmin (176 bytes / 256)."""

    kind: ClassVar[str] = "q5_k"
    code_bits: ClassVar[int] = 5
    sub_block: ClassVar[int] = 32
    ref_search: ClassVar[tuple] = (-0.5, 0.1, 15, False)


@dataclasses.dataclass(frozen=True)
class _SymmetricK(KQuantFormat):
    """q3_k, q6_k: value = d * scale * (code - offset), signed integer scales."""

    has_mins: ClassVar[bool] = False
    scale_dtype: ClassVar[torch.dtype] = torch.int8

    @abstractmethod
    def _fit_sub_blocks(self, subs: Tensor, w: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """(fp32 scale per sub-block, its search's codes), with importance weights w or data-free."""

    @abstractmethod
    def _quantize_scales(self, scales: Tensor, sub_w: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """Sub-block scales [B, S] (sub_w: their summed weights, or None) -> (fp16 d [B], integer scales [B, S])."""

    def _quantize_blocks(self, x: Tensor, imp: Optional[Tensor]) -> dict[str, Tensor]:
        blocks = x.shape[0]
        subs = self._subs(x)
        w = None
        if imp is not None:
            w = self._importance_weights(x, imp)
        scales, levels = self._fit_sub_blocks(subs, None if w is None else self._subs(w))
        sub_w = None if w is None else _sub_block_view(sequential_sum(self._subs(w)), blocks)
        d, sub_scales = self._quantize_scales(_sub_block_view(scales, blocks), sub_w)
        off = self.code_offset
        step = (d.float()[:, None] * sub_scales.float()).reshape(-1, 1)
        recoded = nearest_int(subs / _safe(step)).clamp(-off, off - 1) + off
        levels = torch.where(step != 0, recoded, levels)
        return {"codes": levels.reshape(blocks, SUPER_BLOCK).to(torch.uint8),
                "sub_scales": sub_scales.to(torch.int8), "d": d}

    def _importance_weights(self, x: Tensor, imp: Tensor) -> Tensor:
        """The per-weight weights of the imatrix path (q6_k: the importance itself)."""
        return imp


@dataclasses.dataclass(frozen=True)
class Q3_K(_SymmetricK):
    """ggml Q3_K: 3-bit codes (value code - 4), signed 6-bit scales per 16 weights, fp16 d
    (110 bytes / 256)."""

    kind: ClassVar[str] = "q3_k"
    code_bits: ClassVar[int] = 3
    sub_block: ClassVar[int] = 16
    code_offset: ClassVar[int] = 4
    scale_range: ClassVar[tuple[int, int]] = (-32, 31)

    def _importance_weights(self, x: Tensor, imp: Tensor) -> Tensor:
        sigma2 = 2 * sequential_sum(x * x, keepdim=True) / SUPER_BLOCK
        return imp * sqrtf(sigma2 + x * x)

    def _fit_sub_blocks(self, subs, w):
        if w is None:
            return fit_q3(subs, 4)
        return fit_symmetric(subs, 4, w)

    def _quantize_scales(self, scales, sub_w):
        if sub_w is not None:  # a weighted 6-bit symmetric fit of the scales themselves
            d, levels = fit_symmetric(scales, 32, sub_w)
            return d.half(), levels - 32
        signed, amax = _signed_max(scales)
        nonzero = signed != 0
        iscale = -32 / _safe(signed)
        sub = nearest_int(iscale[:, None] * scales).clamp(-32, 31)
        sub = torch.where(nonzero[:, None], sub, torch.full_like(sub, -32))  # ggml's zeroed bytes
        d = torch.where(nonzero, 1 / iscale, torch.zeros_like(iscale)).half()
        return d, sub


@dataclasses.dataclass(frozen=True)
class Q6_K(_SymmetricK):
    """ggml Q6_K: 6-bit codes (value code - 32), int8 scales per 16 weights, fp16 d (210 bytes / 256)."""

    kind: ClassVar[str] = "q6_k"
    code_bits: ClassVar[int] = 6
    sub_block: ClassVar[int] = 16
    code_offset: ClassVar[int] = 32
    scale_range: ClassVar[tuple[int, int]] = (-128, 127)

    def _fit_sub_blocks(self, subs, w):
        return fit_symmetric(subs, 32, subs * subs if w is None else w)

    def _quantize_scales(self, scales, sub_w):
        signed, amax = _signed_max(scales)
        live = amax >= GROUP_MAX_EPS
        iscale = -128 / _safe(signed)
        sub = nearest_int(iscale[:, None] * scales).clamp(max=127)
        sub = torch.where(live[:, None], sub, torch.zeros_like(sub))  # ggml zeroes the whole block
        d = torch.where(live, 1 / iscale, torch.zeros_like(iscale)).half()
        return d, sub


for _fmt in (Q2_K(), Q3_K(), Q4_K(), Q5_K(), Q6_K()):
    register_format(_fmt)
