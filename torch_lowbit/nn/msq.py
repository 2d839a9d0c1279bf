"""Mixed-scheme quantization (MSQ, Q-Palette §5): each module (a layer, or a q/k/v or gate/up group
that quantize_ fuses) gets one format from a candidate palette, chosen to minimise the predicted loss
of the whole model within a bit budget and/or a measured latency budget, solved exactly.

    tl.quantize_(model, tl.MSQ(target_bpw=2.875))                      # the palette, data-free
    plan = tl.plan_msq(model, tl.MSQ(["tcq2", "tcq3", "q4_k"], 3.0))   # the plan alone, with its report
    print(plan.table()); tl.quantize_(model, plan.formats)
    tl.MSQ(target_latency_ms=4.0)                                      # Σ layer latencies at batch 1
    tl.MSQ(target_tokens_per_s=120)                                    # the same budget as a rate

Loss model (loss=), per layer l and format Q, summed over the plan's layers:
    "linearity" (default, data-free): the linearity theorem (calibrate/linearity.py): a_l · d_l(Q)
        + c_l · d_l(Q)², the layer's KL-divergence curve on text the model samples itself (fit=
        "quadratic"; "linear": c_l = 0, HIGGS's a_l alone), d_l(Q) the relative error ‖W − Q(W)‖² /
        ‖W‖²: for rotated Q-Palette formats their distortion on a standard Gaussian
        (formats/distortion.py: cached, no layer is quantized), for the others measured on the layer.
    "fisher" (calibration batches): Σ_nk F[n,k] (W − Q(W))²[n,k] with F the empirical Fisher
        diagonal (nn/allocate.py's score); every layer is quantized once per candidate.
Fusion (unfuse=True): a q/k/v or gate/up group quantize_ would fuse is offered as one module in one
format and as its layers alone, each in a format of its own (quantize_ still fuses those that land on
one format); the program picks. Latency (target_latency_ms=): each candidate module's forward
measured on this device at `batch` tokens (nn/latency.py, cached per device), fused and alone. Solver (solver=): "exact" (an
integer program solved to optimality, nn/knapsack.py; needs scipy) or "greedy" (gain per bit, bit
budget only). Candidates (candidates=): "palette" (every registered rotated Q-Palette format: NUQ,
VQ, TCQ and its 1MAD variants, 1 to 5 bits), or a list of format names / configs."""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Mapping, Optional, Sequence, Union

from torch import Tensor, nn
from tqdm.auto import tqdm

from ..calibrate.linearity import DEFAULT_NOISE, FITS, loss_curves, self_generated_tokens, unit_name
from ..formats import Format, formats, get_format
from ..formats.distortion import gaussian_distortion, relative_error
from ..formats.palette import PaletteFormat
from . import knapsack
from .allocate import _check_candidates, block_index, build_units, check_budget, quantization_error
from .latency import layer_latency
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
    target_latency_ms: Optional[float] = None  # Σ of the quantized layers' measured latencies at `batch`
    # the same budget as a rate: batch / Σ latency ≥ this (the quantized layers' own rate; the model's is
    # lower by the rest of its step: attention, norms, the head)
    target_tokens_per_s: Optional[float] = None
    batch: int = 1  # tokens per forward call the latencies are measured at (1: decode)
    loss: str = "linearity"
    solver: str = "exact"
    noise: tuple = DEFAULT_NOISE  # relative noise norms of the sensitivity fit
    sequences: int = 4  # self-generated text for the sensitivities: sequences x length tokens
    length: int = 128
    seed: int = 0
    fit: str = "quadratic"  # the KL curve per layer: a·d + c·d² ("linear": a·d, HIGGS's line)
    # {layer fqn: (a, c)} (or a alone: c = 0), e.g. an earlier plan's .sensitivities()
    sensitivities: Optional[Mapping[str, Union[float, tuple]]] = None
    device: str = "cpu"  # whose latency table
    # offer each q/k/v and gate/up group's layers alone too (formats of their own) beside the fused module;
    # False keeps every group in one format (one launch)
    unfuse: bool = True

    def __post_init__(self):
        if not isinstance(self.candidates, str):
            object.__setattr__(self, "candidates", tuple(self.candidates))
        if self.target_bpw is None and self.target_latency_ms is None and self.target_tokens_per_s is None:
            raise ValueError("MSQ needs a budget: target_bpw=... (bits per weight over the quantized layers) "
                             "and/or target_latency_ms=... (their summed measured latency) or target_tokens_per_s=...")
        for name in ("target_bpw", "target_latency_ms", "target_tokens_per_s"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
                                  or v == float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be a positive number of tokens, got {self.batch!r}")
        if self.target_tokens_per_s is not None and self.target_latency_ms is not None:
            raise ValueError("give target_latency_ms or target_tokens_per_s, not both (they are one budget: "
                             "latency = 1000 * batch / tokens_per_s ms)")
        if self.fit not in FITS:
            raise ValueError(f"unknown fit {self.fit!r}; choose one of {', '.join(FITS)}")
        if self.loss not in LOSS_MODELS:
            raise ValueError(f"unknown loss model {self.loss!r}; choose one of {', '.join(LOSS_MODELS)}")
        if self.solver not in ("exact", "greedy"):
            raise ValueError(f"unknown solver {self.solver!r}; choose 'exact' or 'greedy'")
        if self.latency_budget_ms is not None and self.target_bpw is not None and self.solver == "greedy":
            raise ValueError("MSQ with both a bit and a latency budget needs solver='exact'")
        object.__setattr__(self, "noise", tuple(self.noise))

    @property
    def latency_budget_ms(self) -> Optional[float]:
        """The latency budget, given as ms or as a rate (1000 · batch / tokens per second); None without one."""
        if self.target_tokens_per_s is not None:
            return 1e3 * self.batch / self.target_tokens_per_s
        return self.target_latency_ms

    def formats(self) -> list[Format]:
        names = candidate_set(self.candidates) if isinstance(self.candidates, str) else self.candidates
        return _check_candidates(names)


@dataclasses.dataclass(frozen=True)
class UnitChoice:
    members: tuple[str, ...]  # the Linear layers quantized as one module in fmt
    numel: int
    fmt: Format
    loss: float  # predicted loss of these layers in fmt
    latency_s: float  # measured latency of the module (nan without a latency budget)

    @property
    def name(self) -> str:
        return unit_name(self.members)


@dataclasses.dataclass
class MSQPlan:
    """plan_msq's result: formats {fqn: Format} for quantize_, the choice per module and the totals."""
    formats: dict[str, Format]
    units: list[UnitChoice]
    spec: MSQ
    layer_sensitivities: dict[str, tuple[float, float]]  # (a_l, c_l) per layer (linearity), else empty

    @property
    def bpw(self) -> float:
        return sum(u.fmt.bits_per_weight() * u.numel for u in self.units) / sum(u.numel for u in self.units)

    @property
    def predicted_loss(self) -> float:
        return sum(u.loss for u in self.units)

    @property
    def latency_ms(self) -> float:
        """Σ of the modules' measured latencies (nan without a latency budget)."""
        return 1e3 * sum(u.latency_s for u in self.units)

    @property
    def tokens_per_s(self) -> float:
        """batch / Σ latency: the quantized layers' own rate (nan without a latency budget)."""
        return self.spec.batch / (1e-3 * self.latency_ms)

    def sensitivities(self) -> dict[str, tuple[float, float]]:
        """{layer fqn: (a_l, c_l)}: pass as MSQ(sensitivities=...) to plan other budgets without measuring again."""
        return dict(self.layer_sensitivities)

    def table(self) -> str:
        """The plan by block: one row per block index, one column per kind of module (q+k+v, o, ...)."""
        rows: dict[str, dict[str, str]] = {}
        kinds: list[str] = []
        for u in self.units:
            block = block_index(u.members[0]) or "-"
            kind = "+".join(f.rpartition(".")[2] for f in u.members)
            if kind not in kinds:
                kinds.append(kind)
            rows.setdefault(block, {})[kind] = u.fmt.name
        lines = ["| block | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
        for block in sorted(rows, key=lambda b: (not b.isdigit(), int(b) if b.isdigit() else 0, b)):
            lines.append(f"| {block} | " + " | ".join(rows[block].get(k, "") for k in kinds) + " |")
        budget = ", ".join(x for x in (f"target {self.spec.target_bpw:g} bpw" if self.spec.target_bpw else "",
                                       f"{self.latency_ms:.3f} ms at batch {self.spec.batch} (target "
                                       f"{self.spec.latency_budget_ms:g})" if self.spec.latency_budget_ms else "",
                                       f"{self.tokens_per_s:.1f} tokens/s of these layers (target "
                                       f"{self.spec.target_tokens_per_s:g})" if self.spec.target_tokens_per_s else "")
                                if x)
        lines.append(f"{len(self.units)} modules, {self.bpw:.4f} bits per weight ({budget}), predicted loss "
                     f"{self.predicted_loss:.5g} ({self.spec.loss})")
        return "\n".join(lines)


def plan_msq(model: nn.Module, spec: MSQ, *, calibration: Optional[Iterable[Tensor]] = None,
             filter_fn: Optional[FilterFn] = None, include_lm_head: bool = False, fuse: bool = True,
             skip_incompatible: bool = False, progress: bool = True) -> MSQPlan:
    """The MSQ plan of `model` (module doc). fuse: q/k/v and gate/up groups are one module in one
    format, and (MSQ.unfuse) the program also weighs each group unfused (its layers in their own
    formats, their own latencies) against fused."""
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
    if spec.target_bpw is not None:
        check_budget(units, cands, spec.target_bpw, above_is_error=False)
    # the modules the program chooses among: every unit, and (unfuse) each fused unit's layers alone
    # as its alternative
    modules = [(tuple(u.members), [f for f, _, _ in u.options]) for u in units]
    alternatives = []
    if spec.unfuse:
        for i, u in enumerate(units):
            if len(u.members) > 1:
                parts = []
                for fqn in u.members:
                    m = targets[fqn]
                    held = [f for f in cands if f.shape_problem(m.out_features, m.in_features) is None]
                    parts.append(len(modules))
                    modules.append(((fqn,), held))
                alternatives.append((i, parts))
    layer_loss, sens, stats = _layer_losses(model, spec, targets, units, modules, calibration, rounding, progress)
    losses = [[sum(layer_loss[f][fmt.name] for f in members) for fmt in fmts] for members, fmts in modules]
    sizes = [sum(targets[f].weight.numel() for f in members) for members, _ in modules]
    costs, budgets = [], []
    if spec.target_bpw is not None:
        costs.append([[fmt.bits_per_weight() * n for fmt in fmts] for (_, fmts), n in zip(modules, sizes)])
        budgets.append(spec.target_bpw * sum(u.numel for u in units))
    latency = None
    if spec.latency_budget_ms is not None:
        latency = [[_latency(fmt, targets, members, spec) for fmt in fmts] for members, fmts in
                   tqdm(modules, desc="MSQ: latencies", disable=None if progress else True, leave=False)]
        costs.append(latency)
        budgets.append(spec.latency_budget_ms * 1e-3)
        least = sum(min(min(latency[w]), sum(min(latency[p]) for p in parts)) for w, parts in alternatives) + \
            sum(min(latency[i]) for i in range(len(units)) if i not in {w for w, _ in alternatives})
        if least > budgets[-1] and spec.target_tokens_per_s is not None:
            raise ValueError(f"target_tokens_per_s={spec.target_tokens_per_s:g} is above the fastest possible mix "
                             f"({spec.batch / least:.2f} tokens/s of the quantized layers at batch "
                             f"{spec.batch}: each module in its fastest candidate); lower target_tokens_per_s to at "
                             f"most {spec.batch / least:.2f} or add a faster candidate")
        if least > budgets[-1]:
            raise ValueError(f"target_latency_ms={spec.latency_budget_ms:g} is below the fastest possible mix "
                             f"({least * 1e3:.4f} ms at batch {spec.batch}: each module in its fastest candidate); "
                             f"raise target_latency_ms to at least {least * 1e3:.4f} or add a faster candidate")
    choice = knapsack.solve(losses, costs, budgets, spec.solver, alternatives)
    chosen = [UnitChoice(members, n, fmts[j], losses[i][j], latency[i][j] if latency else float("nan"))
              for i, ((members, fmts), n, j) in enumerate(zip(modules, sizes, choice)) if j >= 0]
    plan = MSQPlan({fqn: c.fmt for c in chosen for fqn in c.members}, chosen, spec, sens)
    log.info("MSQ: %d modules, %.4f bits per weight%s, predicted loss %.5g", len(chosen), plan.bpw,
             f", {plan.latency_ms:.3f} ms at batch {spec.batch}" if latency else "", plan.predicted_loss)
    return plan, stats


def _layer_losses(model, spec: MSQ, targets, units, modules, calibration, rounding, progress):
    """{fqn: {format name: predicted loss of that layer in it}} over every candidate some module offers
    it; the layer sensitivities (linearity) and the calibration statistics (fisher)."""
    wanted: dict[str, dict[str, Format]] = {}
    for members, fmts in modules:
        for fqn in members:
            wanted.setdefault(fqn, {}).update({f.name: f for f in fmts})
    stats: dict[str, Tensor] = {}
    if spec.loss == "linearity":
        sens = {f: _curve(f, v) for f, v in (spec.sensitivities or {}).items() if f in wanted}
        missing = {f: [f] for f in wanted if f not in sens}
        if missing:
            tokens = self_generated_tokens(model, spec.sequences, spec.length, spec.seed)
            sens.update(loss_curves(model, missing, tokens=tokens, noise=spec.noise, seed=spec.seed, fit=spec.fit,
                                                progress=progress))
        return {fqn: {name: _on_curve(sens[fqn], _distortion(f, targets[fqn].weight)) for name, f in fmts.items()}
                for fqn, fmts in wanted.items()}, sens, stats
    from ..calibrate import collect_fisher
    calibration = list(calibration)
    stats = collect_stats(model, calibration, {f: targets[f] for f in wanted}, rounding, progress)
    importance = {f: input_importance(s) for f, s in stats.items()}
    fisher = collect_fisher(model, calibration, {f: targets[f] for f in wanted}, progress=progress)
    out = {}
    for fqn, fmts in wanted.items():
        w, per_weight = targets[fqn].weight.detach(), fisher.pop(fqn)
        out[fqn] = {name: quantization_error(f, w, importance.get(fqn), per_weight) for name, f in fmts.items()}
    return out, {}, stats


def _curve(fqn: str, v) -> tuple[float, float]:
    """A given sensitivity as (a, c): a number is a alone."""
    a, c = (v, 0.0) if isinstance(v, (int, float)) else tuple(v)
    if not (a >= 0 and c >= 0):
        raise ValueError(f"MSQ(sensitivities=...): {fqn}: expected a >= 0 or (a, c) >= 0, got {v!r}")
    return float(a), float(c)


def _on_curve(curve: tuple[float, float], d: float) -> float:
    """The predicted KL increase of relative error d: a·d + c·d²."""
    return curve[0] * d + curve[1] * d * d


def _latency(fmt: Format, targets, members, spec: MSQ) -> float:
    layers = [targets[f] for f in members]
    return layer_latency(fmt, sum(m.out_features for m in layers), layers[0].in_features, spec.batch, spec.device)


def _distortion(fmt: Format, weight: Tensor) -> float:
    """d(Q): the Gaussian distortion of a rotated palette format, else the error on the weight."""
    if isinstance(fmt, PaletteFormat) and fmt.rotate:
        return gaussian_distortion(fmt)
    return relative_error(fmt, weight)
