"""quantize_(model, fmt): swap a model's nn.Linear layers for QuantLinear, in place."""
from __future__ import annotations

import logging
from typing import Iterable, Mapping, Optional, Union

from torch import Tensor, nn
from tqdm.auto import tqdm

from ..formats import Format, get_format
from .allocate import MixedBits, allocate_and_collect
from .msq import MSQ, plan_and_collect
from .fusion import Job, fusion_jobs, install_fused, job_members
from .ggml_mixes import NAMED_MIXES, ggml_mix_plan
from .linear import QuantLinear
from .select import ROUNDINGS, FilterFn, FormatSpec, collect_stats, input_importance, rounding_for, select_linears

log = logging.getLogger(__name__)


def _set_child(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def quantize_(model: nn.Module, fmt: Union[FormatSpec, Mapping[str, FormatSpec], MixedBits, MSQ], *,
              filter_fn: Optional[FilterFn] = None, fuse: bool = True, skip_incompatible: bool = False,
              calibration: Optional[Iterable[Tensor]] = None, rounding: Optional[str] = None,
              layout=None, include_lm_head: bool = False, progress: bool = True,
              sequential: bool = False) -> nn.Module:
    """Replaces the model's nn.Linear layers by QuantLinear, in place.

    fmt: one format (name or config) for every selected layer; or one of llama.cpp's K-quant mixes by
    name ("q3_k_m", "q4_k_s", "q4_k_m", "q5_k_m": nn.ggml_mixes, the LM head included as llama.cpp
    does; the pure q2_k / q6_k mixes through ggml_mix_plan(model, "q2_k"), their names being formats);
    or a per-layer plan {fqn: format}
    (e.g. from torch_lowbit.nn.allocate_formats) that quantizes exactly the listed Linear layers,
    each in its own format (filter_fn, if given, narrows it further; include_lm_head is not used);
    or a recipe such as QuaRot(...) (torch_lowbit/quarot.py: rotation, weights, activations, KV cache);
    or MixedBits(candidates, target_bpw[, sensitivity]): allocate_formats picks that plan from the
    candidates within the bit budget (with calibration: errors weighted by the loss's Fisher
    diagonal, one extra forward + backward pass; E[x²] / E[x xᵀ] are collected once for both
    steps), then it is quantized like a plan;
    or MSQ(candidates="palette", target_bpw=...): mixed-scheme quantization (nn/msq.py): the plan
    of least predicted loss (data-free linearity-theorem sensitivities by default) within the budget,
    solved exactly, then quantized like a plan.
    filter_fn(module, fqn) -> bool picks layers (default: all Linear but lm_head / output embeddings).
    fuse: q/k/v and gate/up projections of Llama-like blocks become one fused QuantLinear each
    (under a plan: only where the group's members share one format; the others stay separate).
    skip_incompatible: leave layers whose in_features the group size does not divide in float
    (default: raise, listing them).
    calibration: batches of token ids ([batch, seq] LongTensors) run through the float model to
    weight the rounding by the layers' real inputs. rounding: "rtn" (data-free, the default
    without calibration), "imatrix" (default with calibration: group scales chosen to minimize
    the error weighted by each input feature's E[x²], as llama.cpp's imatrix), "gptq" (GPTQ
    with act-order against E[x xᵀ]) or "mixed" (GPTQ for MLP projections, imatrix for attention).
    include_lm_head: quantize the LM head too (a tied embedding stays float: the head gets its own
    quantized copy). It is the largest matrix of small models and dominates their decode step.
    sequential: calibrate layer by layer on the outputs of the already quantized layers (GPTQ's
    protocol; Llama: q/k/v, o_proj, gate/up, down_proj in turn, calibration/sequential.py) instead
    of on the float model's activations in one pass. Needs the layers in a stack of decoder layers.
    layout: a layout name for every module (default: the best for each weight's device: on CPU
    the int8-activation lut4_i8_n16 where the format allows, lut4_rowmajor for Triton/CUDA).
    Returns the model.
    """
    if getattr(fmt, "is_recipe", False):  # e.g. QuaRot(...): rotation + weights + activations + KV cache
        if rounding is not None and rounding != fmt.rounding:
            raise ValueError(f"quantize_: the recipe sets rounding={fmt.rounding!r}; pass rounding inside it")
        return fmt.apply(model, calibration=calibration, progress=progress, filter_fn=filter_fn, fuse=fuse,
                         skip_incompatible=skip_incompatible, layout=layout, include_lm_head=include_lm_head)
    tied_head = None
    if isinstance(fmt, str) and fmt in NAMED_MIXES:  # llama.cpp's mixes by name: a per-layer plan, the head in it
        fmt = ggml_mix_plan(model, fmt)
        fmt, tied_head = _without_tied_head(model, fmt)
    rounding = rounding or ("imatrix" if calibration is not None else "rtn")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; choose one of {', '.join(ROUNDINGS)}")
    if rounding != "rtn" and calibration is None:
        raise ValueError(f"rounding={rounding!r} needs calibration batches (token ids); pass calibration=...")
    stats: dict[str, Tensor] = {}
    if isinstance(fmt, MixedBits):
        fmt, stats = allocate_and_collect(model, fmt.candidates, fmt.target_bpw, calibration=calibration,
                                          sensitivity=fmt.sensitivity, rounding=rounding, filter_fn=filter_fn,
                                          include_lm_head=include_lm_head, fuse=fuse,
                                          skip_incompatible=skip_incompatible, progress=progress)
    elif isinstance(fmt, MSQ):
        msq_plan, stats = plan_and_collect(model, fmt, calibration=calibration, rounding=rounding, filter_fn=filter_fn,
                                           include_lm_head=include_lm_head, fuse=fuse,
                                           skip_incompatible=skip_incompatible, progress=progress)
        fmt = msq_plan.formats
    plan, jobs, label = plan_jobs(model, fmt, filter_fn=filter_fn, fuse=fuse, skip_incompatible=skip_incompatible,
                                  include_lm_head=include_lm_head)
    targets: dict[str, nn.Linear] = {fqn: model.get_submodule(fqn) for fqn in plan}
    if sequential and rounding == "rtn":
        raise ValueError("sequential=True calibrates layer by layer; it needs a data-aware rounding "
                         "(gptq, imatrix, mixed) and calibration batches")
    if sequential and stats:
        raise ValueError("sequential=True cannot be combined with MixedBits / MSQ (its allocation needs the "
                         "statistics of the float model up front)")
    step = max(1, len(jobs) // 10)  # progress lines for logs, where tqdm's bar is off (no terminal)
    bar = tqdm(total=len(jobs), desc=f"quantize {label}", disable=None if progress else True, leave=False)
    done = 0
    for job, job_stats in _jobs_with_stats(model, jobs, targets, calibration, rounding, stats, sequential, progress):
        first = job_members(job)[0]  # fused members share one input, so one statistic and one format
        quantize_job(model, job, plan[first], layout=layout, **rounding_args(rounding, first, job_stats))
        done += 1
        bar.update(1)
        if progress and (done % step == 0 or done == len(jobs)):
            log.info("quantized %d/%d layer groups to %s", done, len(jobs), label)
    bar.close()
    if tied_head is not None:  # as llama.cpp: one tensor, token_embd, in the head's type
        from .embedding import quantize_embeddings_
        quantize_embeddings_(model, tied_head, layout=layout)
    chosen: dict[tuple[str, str], int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            chosen[m.fmt.name, m.layout.name] = chosen.get((m.fmt.name, m.layout.name), 0) + 1
    for (fmt_name, layout_name), count in sorted(chosen.items()):
        log.info("%d module(s) in %s, layout %s", count, fmt_name, layout_name)
    return model


def _without_tied_head(model: nn.Module, plan: dict[str, str]) -> tuple[dict[str, str], Optional[str]]:
    """A mix plan without the LM head when the head is tied to the input embedding, and the head's format:
    llama.cpp's files then hold one tensor for both (token_embd, typed as the output would be), which
    quantize_embeddings_ makes (a QuantEmbedding and a head sharing its blocks)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not (isinstance(head, nn.Linear) and isinstance(emb, nn.Embedding) and head.weight is emb.weight):
        return plan, None
    fqn = next(n for n, m in model.named_modules() if m is head)
    return {k: v for k, v in plan.items() if k != fqn}, plan.get(fqn)


def _jobs_with_stats(model: nn.Module, jobs: list[Job], targets: dict[str, nn.Linear], calibration,
                     rounding: str, stats: dict[str, Tensor], sequential: bool, progress: bool):
    """(job, statistics) in the order to quantize: all from one float pass (or the given stats),
    or stage by stage from sequential calibration, each stage's jobs quantized before the next
    stage's statistics are collected."""
    if rounding == "rtn":
        yield from ((job, {}) for job in jobs)
        return
    if not sequential:
        stats = stats or collect_stats(model, calibration, targets, rounding, progress)
        yield from ((job, stats) for job in jobs)
        return
    from ..calibrate.sequential import sequential_stats
    by_first = {job_members(job)[0]: job for job in jobs}
    diagonal_only = not any(rounding_for(rounding, f) == "gptq" for f in targets)
    for stage, stage_stats in sequential_stats(model, calibration, targets, diagonal_only=diagonal_only,
                                               progress=progress):
        for fqn in stage:
            if fqn in by_first:
                yield by_first.pop(fqn), stage_stats
    if by_first:  # cannot happen when every job's members share one input (fused groups do)
        raise RuntimeError(f"sequential calibration missed {list(by_first)[:3]}")


def plan_jobs(model: nn.Module, fmt: Union[FormatSpec, Mapping[str, FormatSpec]], *,
              filter_fn: Optional[FilterFn] = None, fuse: bool = True, skip_incompatible: bool = False,
              include_lm_head: bool = False) -> tuple[dict[str, Format], list[Job], str]:
    """What quantize_ will do, without touching a weight (so it also works on a meta-device model):
    the plan {fqn: Format} of the Linear layers to quantize (a format for the selected layers, or a
    per-layer plan checked against the model), their fusion jobs, and a label for logs. Layers a
    format cannot hold raise (or, with skip_incompatible, stay float with a warning)."""
    if isinstance(fmt, Mapping):
        plan = _check_plan(model, fmt, filter_fn)
        label = "mixed plan"
    else:
        fmt = get_format(fmt)
        plan = {fqn: fmt for fqn in select_linears(model, filter_fn, include_lm_head)}
        label = fmt.name
    modules = {fqn: model.get_submodule(fqn) for fqn in plan}
    problems = {fqn: plan[fqn].shape_problem(m.out_features, m.in_features) for fqn, m in modules.items()}
    bad = [f"{fqn}{f' ({plan[fqn].name})' if label != plan[fqn].name else ''} {p}"
           for fqn, p in problems.items() if p]
    if bad and not skip_incompatible:
        raise ValueError(f"{label} cannot hold {len(bad)} layer(s): {'; '.join(bad[:3])}"
                         f"{' …' if len(bad) > 3 else ''}. Pass skip_incompatible=True to keep them in float")
    for line in bad:
        log.warning("left in float: %s", line)
    plan = {fqn: f for fqn, f in plan.items() if not problems[fqn]}
    jobs = fusion_jobs(model, plan, fuse, may_fuse=lambda fqns: len({plan[f] for f in fqns}) == 1)
    return plan, jobs, label


def rounding_args(rounding: str, fqn: str, stats: Mapping[str, Tensor]) -> dict:
    """quantize_job's keyword arguments for the layer fqn under a rounding, from the calibration
    statistics (collect_stats): none (rtn), importance = E[x²] (imatrix) or hessian = E[x xᵀ] (gptq)."""
    how = rounding_for(rounding, fqn)
    if how == "rtn":
        return {}
    if how == "imatrix":
        return {"importance": input_importance(stats[fqn])}
    return {"hessian": stats[fqn]}


def quantize_job(model: nn.Module, job: Job, fmt: Format, *, layout=None, weights: Optional[list[Tensor]] = None,
                 biases: Optional[list[Optional[Tensor]]] = None, importance: Optional[Tensor] = None,
                 hessian: Optional[Tensor] = None) -> QuantLinear:
    """Quantizes one fusion job (a lone Linear, or a q/k/v or gate/up group into one fused module)
    and puts the QuantLinear into the model. weights / biases: the members' tensors in job order
    (default: the members' own; loaders pass tensors as they arrive, before any module holds them)."""
    pfqn, names, fused_name = job
    if weights is None:
        linears = [model.get_submodule(f) for f in job_members(job)]
        weights, biases = [m.weight for m in linears], [m.bias for m in linears]
    quantized = QuantLinear.from_weights(weights, biases, fmt, layout=layout, split=fused_name is not None,
                                         importance=importance, hessian=hessian)
    if fused_name is None:
        _set_child(model, pfqn, quantized)
    else:
        install_fused(model.get_submodule(pfqn) if pfqn else model, tuple(names), fused_name, quantized)
    return quantized


def _check_plan(model: nn.Module, plan: Mapping[str, FormatSpec], filter_fn: Optional[FilterFn]) -> dict[str, Format]:
    """{fqn: Format} of a per-layer plan, every key an nn.Linear of the model (and kept by filter_fn)."""
    modules = dict(model.named_modules())
    out: dict[str, Format] = {}
    for fqn, spec in plan.items():
        m = modules.get(fqn) if isinstance(fqn, str) else None
        if not isinstance(m, nn.Linear):
            what = "no module" if m is None else f"a {type(m).__name__}, not an nn.Linear"
            raise ValueError(f"the format plan lists {fqn!r}, which is {what} of this model; list the fqns of "
                             "its nn.Linear layers (as model.named_modules() names them, before quantizing)")
        if filter_fn is None or filter_fn(m, fqn):
            out[fqn] = get_format(spec)
    return out
