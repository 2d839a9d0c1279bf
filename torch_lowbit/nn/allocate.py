"""Per-layer format allocation: a mix of formats (e.g. gcb2 / gcb3) within a bit budget, chosen by
measured sensitivity (llama.cpp's Q3_K_M-style tensor mixes, but picked per layer from data).

    plan = allocate_formats(model, ["gcb2_sb192", "gcb3_sb192"], 3.2, calibration=batches)
    quantize_(model, plan, calibration=batches)             # {fqn: Format}, quantized as listed
    quantize_(model, MixedBits(["gcb2_sb192", "gcb3_sb192"], 3.2), calibration=batches)  # both steps

Units: a layer, or a q/k/v (gate/up) group that quantize_ fuses into one module; a unit gets one
format. Q: a candidate's data-free quantize→dequantize, its errors weighted by imp_k = E[x_k²] of
the layer's calibration inputs (llama.cpp's imatrix, as rounding="imatrix" does; no GPTQ here: Q
ranks layers, it does not produce them). Sensitivity of a unit to a candidate, by `sensitivity`:

    "fisher" (default with calibration):  score = Σ_nk F[n,k] · (W − Q(W))²[n,k]
        F = E[(∂L/∂W)²], the empirical Fisher diagonal of the next-token loss over the calibration
        batches (one forward + backward each): a second-order estimate of the loss increase.
    "output":                             score = Σ_k imp_k · Σ_n (W − Q(W))²[n,k]
        the layer's own output error E‖(W − Q(W)) x‖² (diagonal part), imp = 1 without calibration.

"output" is cheaper (no backward) but compares absolute errors across depths, and on SmolLM2 it
sends the first blocks (small residual stream, small E[x²]) to the cheap format though they are
among the most sensitive: gcb2/gcb3 with imatrix rounding, it gave perplexity 29.5 at 3.2 bits
per weight (random unit scores: 25.8-30.1; "fisher" 26.4) and 93.1 at 2.8 (random: 65-68;
"fisher" 45.6) (README, "Mixed gcb2/gcb3"). Cost of a unit: bits_per_weight × numel (every code and group
parameter the format counts; a gcb layer's 64-128-byte codebook table is not counted, as in the
format's own bits/weight).

Budget: Σ bits ≤ target_bpw × Σ numel over the allocated units. Solved as a multiple-choice
knapsack by the standard greedy (nn/knapsack.py; MSQ, nn/msq.py, solves it exactly): every unit starts at its cheapest candidate; then, repeatedly,
among the upgrades (a unit to one of its more expensive candidates with a lower score) that still
fit the remaining budget, take the one with the largest score decrease per added bit. It stops
when no upgrade fits. With two candidates this is the fractional-knapsack order, optimal up to the
last unit that did not fit.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..formats import Format, get_format
from ..formats.distortion import squared_error
from . import knapsack
from .fusion import fusion_jobs, job_members
from .select import FilterFn, FormatSpec, collect_stats, input_importance, select_linears


log = logging.getLogger("torch_lowbit")

SENSITIVITIES = ("fisher", "output")


@dataclasses.dataclass(frozen=True)
class MixedBits:
    """quantize_(model, MixedBits(candidates, target_bpw), ...): allocate_formats, then quantize the plan."""
    candidates: Sequence[FormatSpec]
    target_bpw: float
    sensitivity: Optional[str] = None  # allocate_formats' (default: "fisher" with calibration, else "output")

    def __post_init__(self):
        object.__setattr__(self, "candidates", tuple(self.candidates))


@dataclasses.dataclass
class _Unit:
    members: list[str]  # fqns of the Linear layers quantized as one module
    numel: int
    options: list[tuple[Format, float, float]]  # (format, bits, score), by increasing bits


def allocate_formats(model: nn.Module, candidates: Sequence[FormatSpec], target_bpw: float, *,
                     calibration: Optional[Iterable[Tensor]] = None,
                     importance: Optional[Mapping[str, Tensor]] = None, sensitivity: Optional[str] = None,
                     filter_fn: Optional[FilterFn] = None, include_lm_head: bool = False, fuse: bool = True,
                     skip_incompatible: bool = False, progress: bool = True) -> dict[str, Format]:
    """{fqn: Format}: one of `candidates` (names or configs) for each selected Linear layer, with the
    layers' total bits ≤ target_bpw × their weights, least total sensitivity (module doc).

    calibration: batches of token ids ([batch, seq]); their per-input-feature E[x²] weights the
    rounding errors (or pass importance {fqn: E[x²] [in_features]} already collected) and, for
    sensitivity="fisher", their loss gradients weigh each weight. sensitivity: "fisher" (default
    with calibration) or "output" (default without; data-free weight error without importance).
    filter_fn / include_lm_head pick the layers as in quantize_; fuse: q/k/v and gate/up groups get
    one format (quantize_ fuses them). A candidate that cannot hold a layer's shape is not
    considered for it; a layer no candidate holds raises, or with skip_incompatible stays out of
    the plan (float)."""
    return allocate_and_collect(model, candidates, target_bpw, calibration=calibration, importance=importance,
                                sensitivity=sensitivity, filter_fn=filter_fn, include_lm_head=include_lm_head,
                                fuse=fuse, skip_incompatible=skip_incompatible, progress=progress)[0]


def allocate_and_collect(model: nn.Module, candidates: Sequence[FormatSpec], target_bpw: float, *,
                         calibration: Optional[Iterable[Tensor]], sensitivity: Optional[str],
                         importance: Optional[Mapping[str, Tensor]] = None, rounding: str = "imatrix",
                         filter_fn: Optional[FilterFn], include_lm_head: bool, fuse: bool,
                         skip_incompatible: bool, progress: bool) -> tuple[dict[str, Format], dict[str, Tensor]]:
    """allocate_formats, also returning the calibration statistics it collected for `rounding`
    (quantize_'s collect_stats, over every allocated layer; empty when none were needed): quantize_
    rounds the plan with them, so calibration runs once, after the cheap checks."""
    cands = _check_candidates(candidates)
    if isinstance(target_bpw, bool) or not isinstance(target_bpw, (int, float)) or not target_bpw > 0:
        raise ValueError(f"target_bpw must be a positive number of bits per weight, got {target_bpw!r}")
    sensitivity = sensitivity or ("fisher" if calibration is not None else "output")
    if sensitivity not in SENSITIVITIES:
        raise ValueError(f"unknown sensitivity {sensitivity!r}; choose one of {', '.join(SENSITIVITIES)}")
    if sensitivity == "fisher" and calibration is None:
        raise ValueError("sensitivity='fisher' needs calibration batches (token ids); pass calibration=... "
                         "or use sensitivity='output'")
    targets, units = build_units(model, cands, filter_fn=filter_fn, include_lm_head=include_lm_head, fuse=fuse,
                                 skip_incompatible=skip_incompatible, caller="allocate_formats")
    budget = check_budget(units, cands, target_bpw, above_is_error=True)
    choices = [u for u in units if len(u.options) > 1]  # a unit one candidate holds has no choice to score
    stats: dict[str, Tensor] = {}
    if calibration is not None and choices:
        calibration = list(calibration)  # read once or twice (E[x²], then the Fisher pass)
        if importance is None:
            stats = collect_stats(model, calibration, {f: targets[f] for u in units for f in u.members},
                                  rounding, progress)
            importance = {f: input_importance(s) for f, s in stats.items()}
    fisher = None
    if sensitivity == "fisher" and choices:
        from ..calibrate import collect_fisher
        fisher = collect_fisher(model, calibration, {f: targets[f] for u in choices for f in u.members},
                                progress=progress)
    for u in tqdm(choices, desc="allocate: score candidates", disable=None if progress else True, leave=False):
        imp = None if importance is None else importance.get(u.members[0])
        if importance is not None and imp is None:
            raise ValueError(f"allocate_formats: importance has no entry for {u.members[0]}")
        weight = _cat([targets[f].weight.detach() for f in u.members])
        per_weight = None if fisher is None else _cat([fisher.pop(f) for f in u.members])
        u.options = [(f, bits, quantization_error(f, weight, imp, per_weight)) for f, bits, _ in u.options]

    choice = knapsack.solve_greedy([[score for _, _, score in u.options] for u in units],
                                   [[[bits for _, bits, _ in u.options] for u in units]], [budget])
    return {fqn: u.options[j][0] for u, j in zip(units, choice) for fqn in u.members}, stats


def build_units(model: nn.Module, cands: Sequence[Format], *, filter_fn: Optional[FilterFn], include_lm_head: bool,
                fuse: bool, skip_incompatible: bool, caller: str) -> tuple[dict[str, nn.Linear], list[_Unit]]:
    """The selected Linear layers and the units they form (fused groups as quantize_ builds them),
    each with the candidates that can hold it, cheapest first (scores 0 until scored). A candidate
    that cannot hold some unit is left out there, said once per candidate in the log; a unit no
    candidate holds raises, or with skip_incompatible is left out (stays float)."""
    targets = select_linears(model, filter_fn, include_lm_head)
    if not targets:
        raise ValueError(f"{caller}: no nn.Linear layers selected (check filter_fn / the model)")
    units, orphans, skipped = [], [], {}
    for job in fusion_jobs(model, targets, fuse):
        members = job_members(job)
        layers = [targets[f] for f in members]
        n, k = sum(m.out_features for m in layers), layers[0].in_features
        held = []
        for f in cands:
            if all(f.shape_problem(m.out_features, m.in_features) is None for m in layers):
                held.append(f)
            else:
                skipped.setdefault(f.name, []).append(members[0])
        held.sort(key=lambda f: f.storage_bits(n, k))
        if held:
            units.append(_Unit(members, n * k, [(f, f.storage_bits(n, k), 0.0) for f in held]))
        else:
            orphans += [f"{fqn} (in_features={k})" for fqn in members]
    for name, where in skipped.items():
        log.info("%s: %s cannot hold %d unit(s) (e.g. %s): not a candidate there", caller, name, len(where), where[0])
    if orphans and not skip_incompatible:
        raise ValueError(f"none of {', '.join(f.name for f in cands)} can hold {len(orphans)} layer(s): "
                         f"{'; '.join(orphans[:3])}{' …' if len(orphans) > 3 else ''}. Add a candidate whose group "
                         "size divides them, exclude them with filter_fn, or pass skip_incompatible=True to keep "
                         "them in float")
    if not units:
        raise ValueError(f"{caller}: no selected layer can be held by any candidate")
    return targets, units


def check_budget(units: list[_Unit], cands: Sequence[Format], target_bpw: float, above_is_error: bool) -> float:
    """The bit budget target_bpw × the units' weights; raises naming the smallest feasible target
    when no mix fits (and, with above_is_error, the largest useful one when even the priciest mix
    spends less)."""
    total = sum(u.numel for u in units)
    budget = target_bpw * total
    low = sum(u.options[0][1] for u in units)
    high = sum(u.options[-1][1] for u in units)
    cheapest = min(cands, key=lambda f: f.bits_per_weight())
    priciest = max(cands, key=lambda f: f.bits_per_weight())
    if budget < low * (1 - 1e-9):
        raise ValueError(f"target_bpw={target_bpw} is below the cheapest possible mix ({low / total:.4f} bits per "
                         f"weight: each layer in its cheapest candidate, e.g. {cheapest.name} at "
                         f"{cheapest.bits_per_weight():.4f}); raise target_bpw to at least {low / total:.4f} or add a "
                         "cheaper candidate")
    if above_is_error and budget > high * (1 + 1e-9):
        raise ValueError(f"target_bpw={target_bpw} is above the most expensive mix ({high / total:.4f} bits per "
                         f"weight: each layer in its priciest candidate, e.g. {priciest.name} at "
                         f"{priciest.bits_per_weight():.4f}); lower target_bpw, add a richer candidate, or just "
                         f"quantize everything with {priciest.name}")
    return budget


def quantization_error(fmt: Format, weight: Tensor, importance: Optional[Tensor] = None,
                       weight_importance: Optional[Tensor] = None) -> float:
    """Weighted squared error of fmt's data-free quantize→dequantize of weight [N, K] (rounding
    weighted by importance [K]): Σ weight_importance · (W − Q(W))² when given (e.g. the Fisher
    diagonal), else Σ_k importance_k · Σ_n (W − Q(W))²[n, k] (the layer's output error up to the
    off-diagonal terms of E[x xᵀ]), else the plain Σ (W − Q(W))²."""
    err = squared_error(fmt, weight, importance)
    if weight_importance is not None:
        return float((weight_importance.to(err.device).float() * err).sum())
    err = err.sum(0)
    return float(err.sum() if importance is None else (importance.detach().float().to(err.device) * err).sum())


def _cat(rows: list[Tensor]) -> Tensor:
    return torch.cat(rows) if len(rows) > 1 else rows[0]


def _check_candidates(candidates: Sequence[FormatSpec]) -> list[Format]:
    if isinstance(candidates, (str, Format)) or not isinstance(candidates, Iterable):
        raise ValueError(f"candidates must be a list of format names or configs, got {candidates!r}")
    cands = list(dict.fromkeys(get_format(c) for c in candidates))  # unknown names raise, listing the known
    if not cands:
        raise ValueError("allocate_formats: no candidate formats; give two or more, e.g. "
                         "['gcb2_sb192', 'gcb3_sb192'] (see `python -m torch_lowbit formats`)")
    return cands


def plan_bpw(model: nn.Module, plan: Mapping[str, FormatSpec]) -> float:
    """Bits per weight of a plan over its layers (each format's storage of the layer's shape)."""
    shapes = {fqn: tuple(model.get_submodule(fqn).weight.shape) for fqn in plan}
    bits = sum(get_format(f).storage_bits(*shapes[q]) for q, f in plan.items())
    return bits / max(1, sum(n * k for n, k in shapes.values()))


def quantized_bpw(model: nn.Module) -> float:
    """Bits per weight over a (quantized) model's QuantLinear modules: each format's storage of the
    module's shape (nan without any)."""
    from .linear import QuantLinear
    sizes = [(m.fmt.storage_bits(m.out_features, m.in_features), m.in_features * m.out_features)
             for m in model.modules() if isinstance(m, QuantLinear)]
    return sum(b for b, _ in sizes) / sum(n for _, n in sizes) if sizes else float("nan")


def mix_summary(model: nn.Module) -> str:
    """The formats of a quantized model's QuantLinear modules: a table (layer type × format: which
    blocks) and the achieved bits per weight over them."""
    from .linear import QuantLinear
    by_type: dict[str, dict[str, list[str]]] = {}
    for fqn, m in model.named_modules():
        if isinstance(m, QuantLinear):
            kind = fqn.rsplit(".", 1)[-1]
            by_type.setdefault(kind, {}).setdefault(m.fmt.name, []).append(block_index(fqn) or fqn)
    if not by_type:
        return "no quantized layers"
    names = sorted({f for d in by_type.values() for f in d}, key=lambda f: get_format(f).bits_per_weight())
    lines = ["| layer | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for kind, d in by_type.items():
        lines.append(f"| {kind} | " + " | ".join(_ranges(d.get(f, [])) for f in names) + " |")
    count = sum(len(v) for d in by_type.values() for v in d.values())
    lines.append(f"{count} quantized modules (blocks listed per format), {quantized_bpw(model):.4f} bits per weight")
    return "\n".join(lines)


def block_index(fqn: str) -> Optional[str]:
    """The decoder block number in a layer's name ("model.layers.11.mlp.down_proj" → "11"), or None."""
    m = re.search(r"\.(\d+)\.", f".{fqn}.")
    return m.group(1) if m else None


def _ranges(blocks: list[str]) -> str:
    """'0-3, 7, 9-11' for block indices (other names listed as they are); '-' for none."""
    if not blocks:
        return "-"
    nums = sorted(int(b) for b in blocks if b.isdigit())
    out, start = [], None
    for i, b in enumerate(nums):
        if start is None:
            start = b
        if i + 1 == len(nums) or nums[i + 1] != b + 1:
            out.append(f"{start}" if start == b else f"{start}-{b}")
            start = None
    return ", ".join(out + [b for b in blocks if not b.isdigit()])
