"""Calibration statistics: H = E[x xᵀ] of each Linear's input over calibration batches, and the
empirical Fisher diagonal E[(∂L/∂W)²] of the next-token loss for their weights."""
from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

log = logging.getLogger(__name__)


class HessianCollector:
    """Forward pre-hooks on Linear modules that accumulate E[x xᵀ] (fp32 [K, K]) of their inputs, or
    only its diagonal E[x²] ([K], llama.cpp's "imatrix") with diagonal_only. Modules fed the same
    tensor (q/k/v, gate/up) share one result. Call new_batch() before each batch's forward (it
    forgets which tensors were seen), close() after the last, then result()."""

    def __init__(self, modules: dict[str, nn.Linear], *, diagonal_only: bool = False):
        self.modules, self.diagonal_only = modules, diagonal_only
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, int] = {}
        # id(input) -> (first fqn fed it, the tensor): holding the tensor keeps its id from being reused
        self.by_input: dict[int, tuple[str, Tensor]] = {}
        self.alias: dict[str, str] = {}
        self.handles = [m.register_forward_pre_hook(self._hook(f)) for f, m in modules.items()]

    def _hook(self, fqn: str):
        def fn(module, args):
            x = args[0]
            owner = self.by_input.get(id(x), (None, None))[0]
            if owner is not None and owner != fqn:
                self.alias[fqn] = owner
                return
            self.by_input[id(x)] = (fqn, x)
            x2 = x.detach().reshape(-1, x.shape[-1]).float()
            self.sums[fqn] = self.sums.get(fqn, 0) + ((x2 * x2).sum(0) if self.diagonal_only else x2.T @ x2)
            self.counts[fqn] = self.counts.get(fqn, 0) + x2.shape[0]
        return fn

    def new_batch(self) -> None:
        self.by_input.clear()

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.by_input.clear()

    def result(self) -> dict[str, Tensor]:
        out = {f: self.sums[f] / self.counts[f] for f in self.sums}
        for f, owner in self.alias.items():
            if f not in out:
                out[f] = out[owner]
        missing = [f for f in self.modules if f not in out]
        if missing:
            raise RuntimeError(f"calibration never reached {missing[:5]}; are these modules used by forward()?")
        return out


@torch.no_grad()
def collect_hessians(model: nn.Module, batches: Iterable[Tensor], modules: dict[str, nn.Linear], *,
                     diagonal_only: bool = False, progress: bool = True) -> dict[str, Tensor]:
    """Runs the (float) model on each batch of token ids and returns {fqn: E[x xᵀ]} (fp32 [K, K])
    for the given Linear modules, or only its diagonal E[x²] ([K], llama.cpp's "imatrix") with
    diagonal_only. Modules fed the same tensor (q/k/v, gate/up) share one result."""
    collector = HessianCollector(modules, diagonal_only=diagonal_only)
    was_training = model.training
    model.eval()
    try:
        batches = list(batches)
        if progress:
            log.info("calibration: %d batches through the float model (%s)", len(batches),
                     "diagonals E[x^2]" if diagonal_only else "E[x x^T] for GPTQ")
        for ids in tqdm(batches, desc="calibrate", disable=None if progress else True, leave=False):
            collector.new_batch()
            run_batch(model, ids)
    finally:
        collector.close()
        model.train(was_training)
    return collector.result()


def collect_fisher(model: nn.Module, batches: Iterable[Tensor], modules: dict[str, nn.Linear], *,
                   progress: bool = True) -> dict[str, Tensor]:
    """{fqn: E[(∂L/∂W)²]} (fp32, the weight's shape) for the given Linear modules: one forward and
    backward of the mean next-token cross-entropy per batch of token ids, squared gradients
    averaged over the batches (the empirical Fisher diagonal, a loss-aware weight importance).
    Only those weights get gradients; every parameter's requires_grad and .grad are restored."""
    params = list(model.parameters())
    saved = [(p.requires_grad, p.grad) for p in params]
    wanted = {id(m.weight) for m in modules.values()}
    sums = {f: torch.zeros_like(m.weight, dtype=torch.float32) for f, m in modules.items()}
    was_training = model.training
    model.eval()
    n = 0
    try:
        for p in params:
            p.requires_grad_(id(p) in wanted)
            p.grad = None
        with torch.enable_grad():
            for ids in tqdm(list(batches), desc="fisher", disable=None if progress else True, leave=False):
                ids = ids.to(_input_device(model))
                out = run_batch(model, ids)
                logits = out.logits if hasattr(out, "logits") else out
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
                loss.backward()
                for f, m in modules.items():
                    if m.weight.grad is None:
                        raise RuntimeError(f"the loss does not depend on {f}; is it used by forward()?")
                    sums[f] += m.weight.grad.float() ** 2
                    m.weight.grad = None
                n += 1
    finally:
        for p, (req, grad) in zip(params, saved):
            p.requires_grad_(req)
            p.grad = grad
        model.train(was_training)
    if n == 0:
        raise ValueError("collect_fisher: no calibration batches")
    return {f: s / n for f, s in sums.items()}


def _input_device(model: nn.Module) -> torch.device:
    """Where token ids go: the input embedding's device (a model being streamed may have later
    layers still on the meta device), else the first parameter's."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return embeddings.weight.device if embeddings is not None else next(model.parameters()).device


def run_batch(model: nn.Module, ids: Tensor):
    """One calibration forward of a batch of token ids (no KV cache where the model takes use_cache)."""
    ids = ids.to(_input_device(model))
    return model(ids, use_cache=False) if _accepts_use_cache(model) else model(ids)


def _accepts_use_cache(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "use_cache")
