"""gcb2 / gcb3: group-wise fine-grained codebooks (seed paper 000, section 5).

A row is cut into sub-groups of 32 weights inside superblocks of 256 (192 or 64: `gcb2_sb192`, ...). Every sub-group is coded
with one of C small shared codebooks (C = 16 by default; 4 entries for gcb2, 8 for gcb3, int8
values) that were learned once, model-wide, so they fit in one vector register for the whole model:

    w = d * s_j * codebook[c_j][q]      d: fp16 per superblock, s_j in 1..15 (4 bits),
                                        c_j: codebook index (4 bits), q: b-bit code

Bits per weight: b + 8/32 (s_j, c_j) + 16/superblock (d) = b + 0.3125 at 256 (the 64-128-byte
codebook table of a layer is not counted: it is shared and tiny).

Quantization: for every sub-group and every codebook, a least-squares scale (nearest entries and
refit, alternated); keep the codebook of lowest squared error; quantize the scales against the
superblock's d = max / 15; re-pick each sub-group's codebook with its quantized scale. With
calibration (rounding="gptq"), those parameters are fixed first and GPTQ then picks the codes column
by column, feeding each column's error forward (torch_lowbit/calibrate/gptq.py).

Learning (torch_lowbit/tools/gcb_learn.py; CLI `python -m torch_lowbit gcb-learn`): sub-groups normalized by their
absmax, then two k-means phases: (1) over the sub-groups' normalized histograms, giving C
distribution shapes; (2) inside each shape's cluster, 1-D k-means of its values into 2^b
centroids, rounded to int8. The shipped tables (data/gcb_codebooks.safetensors) were learned on
SmolLM2-135M's linear layers.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import ClassVar, Optional

import torch
from torch import Tensor

from ..core.packing import GCB_CODE_BITS, GCB_SUBGROUP
from .base import Format
from .registry import register_format

SUBGROUP = GCB_SUBGROUP  # one sub-group byte per 32 weights (torch_lowbit.core.packing)
SUPERBLOCK = 256
SCALE_STEPS = 15  # s_j in 1..15
_DATA = os.path.join(os.path.dirname(__file__), "data", "gcb_codebooks.safetensors")


def table_key(source: str, bits: int) -> str:
    return f"{source}_b{bits}"


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict[str, Tensor]:
    from safetensors.torch import load_file
    return load_file(path)


def load_codebooks(source: str, bits: int) -> Tensor:
    """int8 [C, 2^bits]: a shipped table by name ("smollm2") or the one in a gcb-learn file."""
    path, key = (_DATA, table_key(source, bits)) if not source.endswith(".safetensors") else (source, f"b{bits}")
    if not os.path.exists(path):
        raise ValueError(f"gcb: codebook file {path!r} not found; write one with "
                         "`python -m torch_lowbit gcb-learn --out FILE.safetensors`")
    tables = _load(path)
    if key not in tables:
        raise ValueError(f"gcb: {path} has no {bits}-bit codebooks (keys: {', '.join(sorted(tables))})")
    cb = tables[key]
    if cb.dtype != torch.int8 or cb.dim() != 2 or cb.shape[1] != 2 ** bits or cb.shape[0] not in (4, 8, 16):
        raise ValueError(f"gcb: codebooks must be int8 [4, 8 or 16, {2 ** bits}], got {cb.dtype} {tuple(cb.shape)}")
    return cb.clone()


def dequantize_subgroups(codes: Tensor, codebook_index: Tensor, sub_scales: Tensor, super_scales: Tensor,
                         codebooks: Tensor) -> Tensor:
    """fp32 W [N, K] = d * s_j * codebooks[c_j][code]: the reference dequantizer of gcb (also the
    portable CPU impl of the gcb ops). The superblock is K / super_scales' columns."""
    codes, cidx = codes.long(), codebook_index.long()
    per_code = codebooks.float()[cidx.repeat_interleave(SUBGROUP, 1), codes]  # [N, K]
    superblock = codes.shape[1] // super_scales.shape[1]
    scale = sub_scales.float() * super_scales.float().repeat_interleave(superblock // SUBGROUP, 1)
    return per_code * scale.repeat_interleave(SUBGROUP, 1)


@dataclasses.dataclass(frozen=True)
class GroupCodebook(Format):
    kind: ClassVar[str] = "gcb"
    layout_family: ClassVar[str] = "gcb"
    bits: int = 2
    codebooks: str = "smollm2"  # a shipped table name, or a .safetensors file written by gcb-learn
    superblock: int = SUPERBLOCK  # weights per fp16 scale d: a multiple of 32 dividing in_features
    lsq_iters: int = 3

    def __post_init__(self):
        if self.bits not in GCB_CODE_BITS:
            raise ValueError(f"gcb: bits must be {' or '.join(map(str, GCB_CODE_BITS))}, got {self.bits}")
        if self.superblock <= 0 or self.superblock % SUBGROUP:
            raise ValueError(f"gcb: superblock must be a positive multiple of {SUBGROUP}, got {self.superblock}")

    @property
    def name(self) -> str:
        name = f"gcb{self.bits}"
        if self.codebooks != "smollm2":
            name += f"_{os.path.splitext(os.path.basename(self.codebooks))[0]}"
        return name if self.superblock == SUPERBLOCK else f"{name}_sb{self.superblock}"

    @property
    def group_size(self) -> int:
        return self.superblock

    def bits_per_weight(self) -> float:
        return self.bits + 8 / SUBGROUP + 16 / self.superblock

    def table(self) -> Tensor:
        return load_codebooks(self.codebooks, self.bits)

    def quantize(self, weight: Tensor, importance: Optional[Tensor] = None) -> dict[str, Tensor]:
        self.check_weight(weight)
        n, k = weight.shape
        x = weight.detach().float().reshape(n, k // SUBGROUP, SUBGROUP)
        w = None if importance is None else self._importance(importance, k)
        cb = self.table()
        values = cb.float().to(x.device)
        # 1. best codebook and least-squares scale per sub-group
        best_err, best_c, best_scale = None, None, None
        for c in range(values.shape[0]):
            scale, err = _fit_scale(x, values[c], w, self.lsq_iters)
            if best_err is None:
                best_err, best_c, best_scale = err, torch.zeros_like(err, dtype=torch.long), scale
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_c = torch.where(better, c, best_c)
                best_scale = torch.where(better, scale, best_scale)
        # 2. scales on the superblock grid d * s, s in 1..SCALE_STEPS
        per_block = self.superblock // SUBGROUP
        blocks = best_scale.reshape(n, k // self.superblock, per_block)
        d = (blocks.amax(-1) / SCALE_STEPS).half()
        df = d.float()[..., None]
        steps = torch.round(blocks / torch.where(df > 0, df, torch.ones_like(df))).clamp_(1, SCALE_STEPS)
        scale = (steps * df).reshape(n, k // SUBGROUP, 1)
        # 3. each sub-group's codebook again, for its quantized scale
        best_err, best_codes = None, None
        for c in range(values.shape[0]):
            codes = _nearest(x, scale, values[c])
            err = _weighted_sq(values[c][codes] * scale - x, w)
            if best_err is None:
                best_err, best_codes, best_c = err, codes, torch.zeros_like(err, dtype=torch.long)
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_c = torch.where(better, c, best_c)
                best_codes = torch.where(better, codes, best_codes)
        return {"codes": best_codes.reshape(n, k).to(torch.uint8), "codebook_index": best_c.reshape(n, k // SUBGROUP).to(torch.uint8),
                "sub_scales": steps.reshape(n, k // SUBGROUP).to(torch.uint8), "super_scales": d,
                "codebooks": cb.to(weight.device)}

    # -- GPTQ (torch_lowbit/calibrate/gptq.py): parameters fixed first, then codes column by column --
    def fixed_parameters(self, weight: Tensor, importance: Optional[Tensor] = None) -> dict[str, Tensor]:
        """Everything but the codes (each sub-group's codebook and scale), chosen as quantize() does."""
        q = self.quantize(weight, importance)
        return {k: v for k, v in q.items() if k != "codes"}

    def encode_column(self, fixed: dict[str, Tensor], col: int, x: Tensor) -> tuple[Tensor, Tensor]:
        """(codes uint8 [N], their values [N]) of column `col` values x [N] under the fixed parameters."""
        grp = col // SUBGROUP
        scale = fixed["sub_scales"][:, grp].float() * fixed["super_scales"][:, col // self.superblock].float()
        candidates = fixed["codebooks"].float()[fixed["codebook_index"][:, grp].long()] * scale[:, None]
        codes = (x[:, None] - candidates).abs().argmin(1)
        return codes.to(torch.uint8), candidates.gather(1, codes[:, None])[:, 0]

    def dequantize(self, q: dict[str, Tensor]) -> Tensor:
        return dequantize_subgroups(q["codes"], q["codebook_index"], q["sub_scales"], q["super_scales"],
                                    q["codebooks"])

    def _importance(self, importance: Tensor, in_features: int) -> Tensor:
        if importance.shape != (in_features,) or not bool(torch.isfinite(importance).all()) or \
                bool((importance < 0).any()):
            raise ValueError(f"{self.name}: importance must be {in_features} finite non-negative values")
        imp = importance.detach().float()
        imp = imp / imp.mean().clamp_min(1e-30) + 1e-6
        return imp.reshape(1, in_features // SUBGROUP, SUBGROUP)


def _weighted_sq(diff: Tensor, w: Optional[Tensor]) -> Tensor:
    return (diff * diff if w is None else w * diff * diff).sum(-1, keepdim=True)


def _nearest(x: Tensor, scale: Tensor, values: Tensor) -> Tensor:
    """Codes of the entries of `values` (sorted) nearest to x / scale."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.bucketize(x / safe, (values[1:] + values[:-1]) / 2)


def _fit_scale(x: Tensor, values: Tensor, w: Optional[Tensor], iters: int) -> tuple[Tensor, Tensor]:
    """Per sub-group: the scale (absmax start, then least-squares refits kept where they help) and its
    squared error, coding x [.., 32] with the sorted entries `values`."""
    top = values.abs().max()
    scale = x.abs().amax(-1, keepdim=True) / top
    v = values[_nearest(x, scale, values)]
    err = _weighted_sq(v * scale - x, w)
    ww = torch.ones_like(x) if w is None else w.expand_as(x)
    for _ in range(iters):
        vv = (ww * v * v).sum(-1, keepdim=True)
        refit = torch.where(vv > 0, (ww * v * x).sum(-1, keepdim=True) / vv.clamp_min(1e-30), scale)
        v_new = values[_nearest(x, refit, values)]
        err_new = _weighted_sq(v_new * refit - x, w)
        better = (refit > 0) & (err_new < err)
        scale, err = torch.where(better, refit, scale), torch.where(better, err_new, err)
        v = torch.where(better, v_new, v)
    return scale, err


# ------------------------------------------------------------------------------------------------
# Learning the codebooks


def _register() -> None:
    if os.path.exists(_DATA):
        for b in GCB_CODE_BITS:
            # superblocks of 256 (LLaMA-size K); 192, 128 and 64 for widths like SmolLM2's 576 or BERT's 384
            for sb in (SUPERBLOCK, 192, 128, 64):
                register_format(GroupCodebook(bits=b, superblock=sb))


_register()
