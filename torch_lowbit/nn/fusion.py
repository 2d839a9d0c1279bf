"""Fused projections: q/k/v (and gate/up) of a Llama-like block become one QuantLinear.

HF modules call q_proj(x), k_proj(x), v_proj(x) separately. We keep that code untouched: the
parent (attention or MLP) gets the fused module as a new child (`qkv_proj`, `gate_up_proj`), its
old children become ProjectionSlot modules, and a forward pre-hook on the parent runs the fused
matmul once on the parent's input and hands each slot its slice (views, no copies). A slot checks
that it is called on that same input, so an architecture that feeds a projection anything else
fails loudly instead of computing garbage. torch.compile traces through the hook (no graph break).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

from torch import Tensor, nn

# (child names, fused child name): projections of one parent that read the parent's own input.
FUSION_GROUPS = ((("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                 (("gate_proj", "up_proj"), "gate_up_proj"))
# Parents whose forward feeds its first input to those children unchanged.
_PARENT_SUFFIXES = ("Attention", "MLP", "SdpaAttention", "FlashAttention2")


class ProjectionSlot(nn.Module):
    """Stands where a fused projection was; returns its slice of the fused output."""

    def __init__(self, fused_name: str, index: int, out_features: int):
        super().__init__()
        self.fused_name, self.index, self.out_features = fused_name, index, out_features
        self._input: Optional[Tensor] = None
        self._output: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        if self._output is None or x is not self._input:
            raise RuntimeError(f"fused projection slot '{self.fused_name}[{self.index}]' was called on an "
                               "input other than its parent module's; this architecture cannot use fused "
                               "projections: quantize with fuse=False")
        return self._output

    def extra_repr(self) -> str:
        return f"{self.fused_name}[{self.index}], out_features={self.out_features}"


def _parent_input(args: tuple, kwargs: dict) -> Tensor:
    if args:
        return args[0]
    for key in ("hidden_states", "x", "input"):
        if key in kwargs:
            return kwargs[key]
    raise RuntimeError("fused projections: could not find the parent module's input tensor")


def _run_fused(parent: nn.Module, args: tuple, kwargs: dict) -> None:
    x = _parent_input(args, kwargs)
    for names, fused_name in parent._lowbit_fusions:
        fused = getattr(parent, fused_name)
        parts = fused(x).split(fused.split_sizes, dim=-1)
        for name, part in zip(names, parts):
            slot = getattr(parent, name)
            slot._input, slot._output = x, part


def _release(parent: nn.Module, args: tuple, kwargs: dict, output) -> None:
    for names, _ in parent._lowbit_fusions:
        for name in names:
            slot = getattr(parent, name)
            slot._input = slot._output = None


def install_fused(parent: nn.Module, names: tuple[str, ...], fused_name: str, fused: nn.Module) -> None:
    """Puts `fused` on parent as `fused_name` and slots in place of `names` (hooks installed once)."""
    setattr(parent, fused_name, fused)
    for i, (name, size) in enumerate(zip(names, fused.split_sizes)):
        setattr(parent, name, ProjectionSlot(fused_name, i, size))
    if not hasattr(parent, "_lowbit_fusions"):
        parent._lowbit_fusions = []
        parent.register_forward_pre_hook(_run_fused, with_kwargs=True)
        parent.register_forward_hook(_release, with_kwargs=True)
    parent._lowbit_fusions.append((tuple(names), fused_name))


def fusable_groups(parent: nn.Module) -> list[tuple[tuple[str, ...], str]]:
    """The FUSION_GROUPS whose children are all present on this (attention / MLP) parent."""
    if not type(parent).__name__.endswith(_PARENT_SUFFIXES):
        return []
    found = []
    for names, fused_name in FUSION_GROUPS:
        children = [getattr(parent, n, None) for n in names]
        if all(isinstance(c, nn.Linear) for c in children) and len({c.in_features for c in children}) == 1:
            found.append((names, fused_name))
    return found


# (parent fqn, child names, fused child name) for a fused group; (fqn, [], None) for a lone layer
Job = tuple[str, list[str], Optional[str]]


def fusion_jobs(model: nn.Module, targets: Iterable[str], fuse: bool = True,
                may_fuse: Optional[Callable[[list[str]], bool]] = None) -> list[Job]:
    """How quantize_ will build the given Linear layers (fqns): one job per fused group whose
    members are all targets (and pass may_fuse(member fqns), e.g. "all share one format"), then
    one per remaining layer. fuse=False: every layer alone."""
    targets = list(targets)
    wanted = set(targets)
    jobs: list[Job] = []
    done: set[str] = set()
    if fuse:
        for pfqn, parent in model.named_modules():
            for names, fused_name in fusable_groups(parent):
                fqns = [f"{pfqn}.{n}" if pfqn else n for n in names]
                if all(f in wanted for f in fqns) and (may_fuse is None or may_fuse(fqns)):
                    jobs.append((pfqn, list(names), fused_name))
                    done.update(fqns)
    jobs += [(fqn, [], None) for fqn in targets if fqn not in done]
    return jobs


def job_members(job: Job) -> list[str]:
    """The fqns of the Linear layers a job quantizes."""
    pfqn, names, fused_name = job
    if fused_name is None:
        return [pfqn]
    return [f"{pfqn}.{n}" if pfqn else n for n in names]
