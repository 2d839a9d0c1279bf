"""quantize_(model, fmt): swap a model's nn.Linear layers for QuantLinear, in place."""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..formats import Format, get_format
from .fusion import fusable_groups, install_fused
from .linear import QuantLinear

FilterFn = Callable[[nn.Module, str], bool]


def default_filter(model: nn.Module, include_lm_head: bool = False) -> FilterFn:
    """Every nn.Linear except (unless include_lm_head) the LM head / output embeddings.
    Embeddings are not Linear, so they stay float either way."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        return include_lm_head or (module is not head and fqn.split(".")[-1] != "lm_head")

    return keep


def _set_child(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


ROUNDINGS = ("rtn", "imatrix", "gptq", "mixed")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2", "w1", "w2", "w3")


def _rounding_for(rounding: str, fqn: str) -> str:
    """Per-layer rounding; "mixed" = GPTQ for MLP projections, imatrix for attention. On SmolLM2
    GPTQ lowered MLP error but raised perplexity when applied to q/k/v/o (README, calibration)."""
    if rounding != "mixed":
        return rounding
    return "gptq" if fqn.rsplit(".", 1)[-1] in _MLP_NAMES else "imatrix"


def quantize_(model: nn.Module, fmt: Union[str, Format], *, filter_fn: Optional[FilterFn] = None,
              fuse: bool = True, skip_incompatible: bool = False,
              calibration: Optional[Iterable[Tensor]] = None, rounding: Optional[str] = None,
              layout=None, include_lm_head: bool = False, progress: bool = True) -> nn.Module:
    """Replaces the model's nn.Linear layers by QuantLinear in format `fmt` (name or config), in place.

    filter_fn(module, fqn) -> bool picks layers (default: all Linear but lm_head / output embeddings).
    fuse: q/k/v and gate/up projections of Llama-like blocks become one fused QuantLinear each.
    skip_incompatible: leave layers whose in_features the group size does not divide in float
    (default: raise, listing them).
    calibration: batches of token ids ([batch, seq] LongTensors) run through the float model to
    weight the rounding by the layers' real inputs. rounding: "rtn" (data-free, the default
    without calibration), "imatrix" (default with calibration: group scales chosen to minimize
    the error weighted by each input feature's E[x²], as llama.cpp's imatrix), "gptq" (GPTQ
    with act-order against E[x xᵀ]) or "mixed" (GPTQ for MLP projections, imatrix for attention).
    include_lm_head: quantize the LM head too (a tied embedding stays float: the head gets its own
    quantized copy). It is the largest matrix of small models and dominates their decode step.
    layout: a layout name for every module (default: the best for each weight's device: on CPU
    the int8-activation lut4_i8_n16 where the format allows, lut4_rowmajor for Triton/CUDA).
    Returns the model.
    """
    fmt = get_format(fmt)
    rounding = rounding or ("imatrix" if calibration is not None else "rtn")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; choose one of {', '.join(ROUNDINGS)}")
    if rounding != "rtn" and calibration is None:
        raise ValueError(f"rounding={rounding!r} needs calibration batches (token ids); pass calibration=...")
    keep = filter_fn or default_filter(model, include_lm_head)
    targets = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, fqn)}
    problems = {fqn: fmt.shape_problem(m.out_features, m.in_features) for fqn, m in targets.items()}
    bad = [f"{fqn} {p}" for fqn, p in problems.items() if p]
    if bad and not skip_incompatible:
        raise ValueError(f"{fmt.name} cannot hold {len(bad)} layer(s): {'; '.join(bad[:3])}"
                         f"{' …' if len(bad) > 3 else ''}. Pass skip_incompatible=True to keep them in float")
    targets = {fqn: m for fqn, m in targets.items() if not problems[fqn]}

    jobs: list[tuple[str, list[str], Optional[str]]] = []  # (parent fqn, child names, fused name)
    done: set[str] = set()
    if fuse:
        for pfqn, parent in model.named_modules():
            for names, fused_name in fusable_groups(parent):
                fqns = [f"{pfqn}.{n}" if pfqn else n for n in names]
                if all(f in targets for f in fqns):
                    jobs.append((pfqn, list(names), fused_name))
                    done.update(fqns)
    for fqn in targets:
        if fqn not in done:
            jobs.append((fqn, [], None))

    stats: dict[str, Tensor] = {}
    if rounding != "rtn":
        from ..calibrate import collect_hessians
        full = any(_rounding_for(rounding, f) == "gptq" for f in targets)
        stats = collect_hessians(model, calibration, targets, diagonal_only=not full, progress=progress)

    def data_args(fqn: str) -> dict:
        how = _rounding_for(rounding, fqn)
        if how == "rtn":
            return {}
        stat = stats[fqn]
        if how == "imatrix":
            return {"importance": torch.diagonal(stat) if stat.dim() == 2 else stat}
        return {"hessian": stat}

    for pfqn, names, fused_name in tqdm(jobs, desc=f"quantize {fmt.name}", disable=None if progress else True, leave=False):
        if fused_name is None:
            _set_child(model, pfqn, QuantLinear.from_linear(targets[pfqn], fmt, layout=layout, **data_args(pfqn)))
        else:
            parent = model.get_submodule(pfqn) if pfqn else model
            first = f"{pfqn}.{names[0]}" if pfqn else names[0]  # one input, so one statistic for all
            fused = QuantLinear.from_linears([getattr(parent, n) for n in names], fmt, layout=layout,
                                             **data_args(first))
            install_fused(parent, tuple(names), fused_name, fused)
    return model
