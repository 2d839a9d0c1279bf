"""Sequential calibration (GPTQ's own protocol, "true sequential" in AutoGPTQ / GPTQModel): each
layer's statistics are collected on the inputs the *already quantized* earlier layers produce, so
its rounding can correct the error upstream instead of fitting the float model's activations.

The model runs once up to its first decoder layer (the inputs of that layer are kept); then, layer
by layer, the layer's Linear targets are quantized in the order they are read (Llama: q/k/v, then
o_proj, then gate/up, then down_proj), each stage calibrated on a forward of the layer with the
stages before it already quantized; the quantized layer's outputs become the next layer's inputs.
Targets outside the decoder layers (an LM head) are calibrated last, on the quantized model.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .hessian import HessianCollector, collect_hessians, run_batch

Stages = Iterator[tuple[list[str], dict[str, Tensor]]]  # (fqns of one stage, their statistics)


class _Stop(Exception):
    """Raised from a hook to end a forward once what it was run for has been seen."""


def decoder_layers(model: nn.Module, targets: Iterable[str]) -> Optional[tuple[str, nn.ModuleList]]:
    """(fqn, ModuleList) of the stack of decoder layers holding the most targets, or None."""
    targets = list(targets)
    best, best_count = None, 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0:
            continue
        prefix = f"{name}." if name else ""
        count = sum(1 for f in targets if f.startswith(prefix) and f[len(prefix):].split(".", 1)[0].isdigit())
        if count > best_count:
            best, best_count = (name, m), count
    return best


def _layer_index(fqn: str, stack: str) -> Optional[int]:
    prefix = f"{stack}." if stack else ""
    if not fqn.startswith(prefix):
        return None
    head = fqn[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _hidden(out) -> Tensor:
    """A decoder layer's output hidden states (transformers < 5 returns a tuple)."""
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, first: nn.Module, batches: Iterable[Tensor]) -> list[tuple[tuple, dict]]:
    """(args, kwargs) of the first decoder layer's call for each batch of token ids (the forward stops
    there, so later layers may still be on the meta device); first_hidden() reads the hidden states."""
    captured: list[tuple[tuple, dict]] = []

    def hook(module, args, kwargs):
        captured.append((tuple(args), dict(kwargs)))
        raise _Stop

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in batches:
            try:
                run_batch(model, ids)
            except _Stop:
                pass
            else:
                raise RuntimeError("sequential calibration: the model's forward never called its first decoder layer")
    finally:
        handle.remove()
    if not captured:
        raise ValueError("sequential calibration: the calibration batches are empty")
    return captured


def _call(layer: nn.Module, args: tuple, kwargs: dict, hidden: Tensor):
    return layer(hidden, *args[1:], **kwargs) if args else layer(**{**kwargs, "hidden_states": hidden})


def first_hidden(call: tuple[tuple, dict]) -> Tensor:
    """The hidden states of a captured layer call."""
    args, kwargs = call
    return (args[0] if args else kwargs["hidden_states"]).detach()


@torch.no_grad()
def layer_outputs(layer: nn.Module, calls: list[tuple[tuple, dict]], hidden: list[Tensor]) -> list[Tensor]:
    """The layer's output hidden states for each batch: the next layer's inputs."""
    return [_hidden(_call(layer, args, kwargs, h)).detach() for (args, kwargs), h in zip(calls, hidden)]


def calibrate_layer(layer: nn.Module, fqns: list[str], model: nn.Module, calls: list[tuple[tuple, dict]],
                    hidden: list[Tensor], *, diagonal_only: bool = False) -> Stages:
    """Yields (stage, statistics) for the layer's Linear modules `fqns` (model fqns) in the order the
    layer reads them; the caller quantizes each stage before asking for the next one."""
    modules = {f: model.get_submodule(f) for f in fqns}
    stages, once = _read_order(layer, modules, *calls[0], hidden[0])
    for stage in stages:
        yield stage, _stage_stats(layer, stage, model, calls, hidden, diagonal_only, once)


@torch.no_grad()
def _read_order(layer: nn.Module, modules: dict[str, nn.Module], args: tuple, kwargs: dict,
                hidden: Tensor) -> tuple[list[list[str]], bool]:
    """The modules' stages in the order the layer reads them: modules fed the same tensor form one
    stage. Also whether each module was called exactly once (then a stage's pass may stop early)."""
    seen: list[tuple[str, int]] = []
    keep: list[Tensor] = []  # holds the inputs so their ids stay unique during the pass

    def hook_for(fqn):
        def fn(module, a):
            seen.append((fqn, id(a[0])))
            keep.append(a[0])
        return fn

    handles = [m.register_forward_pre_hook(hook_for(f)) for f, m in modules.items()]
    try:
        _call(layer, args, kwargs, hidden)
    finally:
        for h in handles:
            h.remove()
    missing = [f for f in modules if f not in {f for f, _ in seen}]
    if missing:
        raise RuntimeError(f"sequential calibration: the decoder layer never called {missing[:3]}")
    once = len(seen) == len(modules)
    stages: list[list[str]] = []
    stage_of_input: dict[int, int] = {}
    for fqn, key in seen:
        if any(fqn in s for s in stages):
            continue
        if key not in stage_of_input:
            stage_of_input[key] = len(stages)
            stages.append([])
        stages[stage_of_input[key]].append(fqn)
    return stages, once


@torch.no_grad()
def _stage_stats(layer: nn.Module, stage: list[str], model: nn.Module, inputs, hidden: list[Tensor],
                 diagonal_only: bool, stop_early: bool) -> dict[str, Tensor]:
    """Statistics of one stage (modules fed one tensor) over every batch's layer forward: collected
    on its first module, shared by the others."""
    first = model.get_submodule(stage[0])
    collector = HessianCollector({stage[0]: first}, diagonal_only=diagonal_only)
    stop = None
    if stop_early:  # the stage's one input has been seen: the rest of the layer is not needed
        def end_forward(module, args):
            raise _Stop
        # registered after the collector's hook on the same module, so it runs after it
        stop = first.register_forward_pre_hook(end_forward)
    try:
        for (args, kwargs), h in zip(inputs, hidden):
            collector.new_batch()
            try:
                _call(layer, args, kwargs, h)
            except _Stop:
                pass
    finally:
        collector.close()
        if stop is not None:
            stop.remove()
    stat = collector.result()[stage[0]]
    return {f: stat for f in stage}


@torch.no_grad()
def sequential_stats(model: nn.Module, batches: Iterable[Tensor], targets: dict[str, nn.Linear], *,
                     diagonal_only: bool = False, progress: bool = True) -> Stages:
    """Yields (fqns, statistics) stage by stage; the caller must quantize those fqns before asking
    for the next stage (later stages are calibrated on their outputs). Statistics are E[x xᵀ] (or
    E[x²] with diagonal_only) of each listed Linear's input, as collect_hessians gives them for the
    float model. Raises ValueError when the model has no stack of decoder layers holding the targets."""
    batches = list(batches)
    found = decoder_layers(model, targets)
    if found is None:
        raise ValueError("sequential calibration needs the targets inside a stack of decoder layers "
                         "(an nn.ModuleList such as model.layers); pass sequential=False")
    stack, layers = found
    per_layer: dict[int, list[str]] = {}
    outside: list[str] = []
    for fqn in targets:
        i = _layer_index(fqn, stack)
        (per_layer.setdefault(i, []) if i is not None and i < len(layers) else outside).append(fqn)
    was_training = model.training
    model.eval()
    try:
        calls = capture_layer_inputs(model, layers[0], batches)
        hidden = [first_hidden(c) for c in calls]
        last = max(per_layer) if per_layer else -1
        for i in tqdm(range(last + 1), desc="calibrate (sequential)", disable=None if progress else True, leave=False):
            if per_layer.get(i):
                yield from calibrate_layer(layers[i], per_layer[i], model, calls, hidden, diagonal_only=diagonal_only)
            if i < last:
                hidden = layer_outputs(layers[i], calls, hidden)
        if outside:  # e.g. the LM head: one pass of the quantized model
            modules = {f: model.get_submodule(f) for f in outside}
            yield outside, collect_hessians(model, batches, modules, diagonal_only=diagonal_only, progress=False)
    finally:
        model.train(was_training)
