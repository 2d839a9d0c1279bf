"""Mixed-scheme quantization (MSQ, Q-Palette §5): each unit (a layer, or a q/k/v or gate/up group that
quantize_ fuses into one module) gets one format from a candidate palette, chosen to minimise the
predicted loss of the whole model within a bit budget, solved exactly.

    tl.quantize_(model, tl.MSQ(target_bpw=2.875))                      # the palette, data-free
    plan = tl.plan_msq(model, tl.MSQ(["tcq2", "tcq3", "q4_k"], 3.0))   # the plan alone, with its report
    print(plan.table()); tl.quantize_(model, plan.formats)

Loss model (loss=):
    "linearity" (default, data-free): the linearity theorem (calibrate/linearity.py): predicted loss
        of a plan = Σ_u a_u · d_u(Q), a_u the unit's KL-divergence sensitivity on text the model
        samples itself, d_u(Q) the relative error ‖W − Q(W)‖² / ‖W‖² of Q on the unit: for rotated
        Q-Palette formats their distortion on a standard Gaussian (formats/distortion.py: cached, no
        layer is quantized), for the others measured on the unit's weight (data-free rounding).
    "fisher" (calibration batches): Σ_nk F[n,k] (W − Q(W))²[n,k] with F the empirical Fisher
        diagonal (nn/allocate.py's score); every unit is quantized once per candidate.
Solver (solver=): "exact" (an integer program solved to optimality, nn/knapsack.py; needs scipy) or
"greedy" (gain per bit). Candidates (candidates=): "palette" (every registered Q-Palette format:
NUQ, VQ, TCQ and its 1MAD variants at 1 to 5 bits), or a list of format names / configs."""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Iterable, Mapping, Optional, Sequence, Union

from torch import Tensor, nn

from ..calibrate.linearity import DEFAULT_NOISE, linearity_sensitivities, self_generated_tokens, unit_name
from ..formats import Format, formats, get_format
from ..formats.distortion import gaussian_distortion, relative_error
from ..formats.palette import PaletteFormat
from . import knapsack
from .allocate import _cat, _check_candidates, build_units, check_budget, quantization_error
from .select import FilterFn, FormatSpec, collect_stats, input_importance

log = logging.getLogger("torch_lowbit")

LOSS_MODELS = ("linearity", "fisher")


def candidate_set(name: str) -> list[str]:
    """The formats a named candidate set stands for ("palette": every Q-Palette format)."""
    if name == "palette":
        return sorted((f for f in formats() if isinstance(get_format(f), PaletteFormat) and get_format(f).rotate),
                      key=lambda f: (get_format(f).bits_per_weight(), f))
    raise ValueError(f"unknown candidate set {name!r}; use 'palette' or a list of format names")


@dataclasses.dataclass(frozen=True)
class MSQ:
    """quantize_(model, MSQ(...)): plan_msq, then quantize the plan (module doc)."""
    candidates: Union[str, Sequence[FormatSpec]] = "palette"
    target_bpw: Optional[float] = None
    loss: str = "linearity"
    solver: str = "exact"
    noise: tuple = DEFAULT_NOISE  # relative noise norms of the sensitivity fit
    sequences: int = 8  # self-generated text for the sensitivities: sequences x length tokens
    length: int = 128
    seed: int = 0
    sensitivities: Optional[Mapping[str, float]] = None  # {unit name: a}, from an earlier plan's report

    def __post_init__(self):
        if not isinstance(self.candidates, str):
            object.__setattr__(self, "candidates", tuple(self.candidates))
        if self.target_bpw is None:
            raise ValueError("MSQ needs a budget: target_bpw=... (bits per weight over the quantized layers)")
        if isinstance(self.target_bpw, bool) or not isinstance(self.target_bpw, (int, float)) or \
                not self.target_bpw > 0:
            raise ValueError(f"target_bpw must be a positive number of bits per weight, got {self.target_bpw!r}")
        if self.loss not in LOSS_MODELS:
            raise ValueError(f"unknown loss model {self.loss!r}; choose one of {', '.join(LOSS_MODELS)}")
        if self.solver not in ("exact", "greedy"):
            raise ValueError(f"unknown solver {self.solver!r}; choose 'exact' or 'greedy'")
        object.__setattr__(self, "noise", tuple(self.noise))

    def formats(self) -> list[Format]:
        names = candidate_set(self.candidates) if isinstance(self.candidates, str) else self.candidates
        return _check_candidates(names)


@dataclasses.dataclass(frozen=True)
class UnitChoice:
    name: str  # calibrate.linearity.unit_name(members)
    members: tuple[str, ...]
    numel: int
    fmt: Format
    distortion: float  # d_u: relative error of fmt on this unit (linearity), or nan (fisher)
    sensitivity: float  # a_u (linearity), or nan (fisher)
    loss: float  # predicted loss of this unit in fmt


@dataclasses.dataclass
class MSQPlan:
    """plan_msq's result: formats {fqn: Format} for quantize_, the choice per unit and the totals."""
    formats: dict[str, Format]
    units: list[UnitChoice]
    target_bpw: float
    loss_model: str

    @property
    def bpw(self) -> float:
        return sum(u.fmt.bits_per_weight() * u.numel for u in self.units) / sum(u.numel for u in self.units)

    @property
    def predicted_loss(self) -> float:
        return sum(u.loss for u in self.units)

    def sensitivities(self) -> dict[str, float]:
        """{unit name: a_u}: pass as MSQ(sensitivities=...) to plan other budgets without measuring again."""
        return {u.name: u.sensitivity for u in self.units}

    def table(self) -> str:
        """The plan by block: one row per block index, one column per kind of unit (q+k+v, o, ...)."""
        rows: dict[str, dict[str, str]] = {}
        kinds: list[str] = []
        for u in self.units:
            m = re.search(r"\.(\d+)\.", f".{u.members[0]}.")
            block = m.group(1) if m else "-"
            kind = "+".join(f.rpartition(".")[2] for f in u.members)
            if kind not in kinds:
                kinds.append(kind)
            rows.setdefault(block, {})[kind] = u.fmt.name
        lines = ["| block | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
        for block in sorted(rows, key=lambda b: (not b.isdigit(), int(b) if b.isdigit() else 0, b)):
            lines.append(f"| {block} | " + " | ".join(rows[block].get(k, "") for k in kinds) + " |")
        lines.append(f"{len(self.units)} units, {self.bpw:.4f} bits per weight (target {self.target_bpw:g}), "
                     f"predicted loss {self.predicted_loss:.5g} ({self.loss_model})")
        return "\n".join(lines)


def plan_msq(model: nn.Module, spec: MSQ, *, calibration: Optional[Iterable[Tensor]] = None,
             filter_fn: Optional[FilterFn] = None, include_lm_head: bool = False, fuse: bool = True,
             skip_incompatible: bool = False, progress: bool = True) -> MSQPlan:
    """The MSQ plan of `model` (module doc): a format per selected layer, fused groups sharing one."""
    plan, _ = plan_and_collect(model, spec, calibration=calibration, rounding="rtn", filter_fn=filter_fn,
                               include_lm_head=include_lm_head, fuse=fuse, skip_incompatible=skip_incompatible,
                               progress=progress)
    return plan


def plan_and_collect(model: nn.Module, spec: MSQ, *, calibration: Optional[Iterable[Tensor]], rounding: str,
                     filter_fn: Optional[FilterFn], include_lm_head: bool, fuse: bool, skip_incompatible: bool,
                     progress: bool) -> tuple[MSQPlan, dict[str, Tensor]]:
    """plan_msq, also returning the calibration statistics it collected for `rounding` (fisher only),
    so that quantize_ rounds the plan without a second pass."""
    if not isinstance(spec, MSQ):
        raise TypeError(f"plan_msq takes an MSQ(...), got {type(spec).__name__}")
    cands = spec.formats()
    if spec.loss == "fisher" and calibration is None:
        raise ValueError("MSQ(loss='fisher') needs calibration batches (token ids); pass calibration=... or use "
                         "the data-free loss='linearity'")
    targets, units = build_units(model, cands, filter_fn=filter_fn, include_lm_head=include_lm_head, fuse=fuse,
                                 skip_incompatible=skip_incompatible, caller="MSQ")
    budget = check_budget(units, cands, spec.target_bpw, above_is_error=False)
    names = [unit_name(u.members) for u in units]
    stats: dict[str, Tensor] = {}
    if spec.loss == "linearity":
        sens = dict(spec.sensitivities or {})
        missing = {n: u.members for n, u in zip(names, units) if n not in sens}
        if missing:
            tokens = self_generated_tokens(model, spec.sequences, spec.length, spec.seed)
            sens.update(linearity_sensitivities(model, missing, tokens=tokens, noise=spec.noise, seed=spec.seed,
                                                progress=progress))
        rows = []
        for n, u in zip(names, units):
            weight = _cat([targets[f].weight.detach() for f in u.members])
            dist = [_distortion(f, weight) for f, _, _ in u.options]
            rows.append([(f, bits, sens[n] * d, d) for (f, bits, _), d in zip(u.options, dist)])
        per_unit_sens = [sens[n] for n in names]
    else:
        from ..calibrate import collect_fisher
        calibration = list(calibration)
        stats = collect_stats(model, calibration, {f: targets[f] for u in units for f in u.members}, rounding, progress)
        importance = {f: input_importance(s) for f, s in stats.items()}
        fisher = collect_fisher(model, calibration, {f: targets[f] for u in units for f in u.members},
                                progress=progress)
        rows = []
        for u in units:
            weight = _cat([targets[f].weight.detach() for f in u.members])
            per_weight = _cat([fisher.pop(f) for f in u.members])
            imp = importance.get(u.members[0])
            rows.append([(f, bits, quantization_error(f, weight, imp, per_weight), float("nan"))
                         for f, bits, _ in u.options])
        per_unit_sens = [float("nan")] * len(units)
    choice = knapsack.solve([[loss for _, _, loss, _ in r] for r in rows], [[[b for _, b, _, _ in r] for r in rows]],
                            [budget], spec.solver)
    chosen = [UnitChoice(n, tuple(u.members), u.numel, r[j][0], r[j][3], a, r[j][2])
              for n, u, r, j, a in zip(names, units, rows, choice, per_unit_sens)]
    plan = MSQPlan({fqn: c.fmt for c in chosen for fqn in c.members}, chosen, float(spec.target_bpw), spec.loss)
    log.info("MSQ: %d units, %.4f bits per weight (target %g), predicted loss %.5g", len(chosen), plan.bpw,
             spec.target_bpw, plan.predicted_loss)
    return plan, stats


def _distortion(fmt: Format, weight: Tensor) -> float:
    """d_u(Q): the Gaussian distortion of a rotated palette format, else the error on the weight."""
    if isinstance(fmt, PaletteFormat) and fmt.rotate:
        return gaussian_distortion(fmt)
    return relative_error(fmt, weight)
