"""Which layers a quantization touches and what it measures on them first: layer selection, the
per-layer rounding policy and calibration statistics (shared by quantize_ and allocate_formats)."""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch
from torch import Tensor, nn

from ..formats import Format

FilterFn = Callable[[nn.Module, str], bool]
FormatSpec = Union[str, Format]


def default_filter(model: nn.Module, include_lm_head: bool = False) -> FilterFn:
    """Every nn.Linear except (unless include_lm_head) the LM head / output embeddings.
    Embeddings are not Linear, so they stay float either way."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        return include_lm_head or (module is not head and fqn.split(".")[-1] != "lm_head")

    return keep


def select_linears(model: nn.Module, filter_fn: Optional[FilterFn] = None,
                   include_lm_head: bool = False) -> dict[str, nn.Linear]:
    """{fqn: module} of the nn.Linear layers filter_fn (default: default_filter) keeps."""
    keep = filter_fn or default_filter(model, include_lm_head)
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, fqn)}


ROUNDINGS = ("rtn", "imatrix", "gptq", "mixed")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2", "w1", "w2", "w3")


def rounding_for(rounding: str, fqn: str) -> str:
    """Per-layer rounding; "mixed" = GPTQ for MLP projections, imatrix for attention. On SmolLM2
    GPTQ lowered MLP error but raised perplexity when applied to q/k/v/o (README, calibration)."""
    if rounding != "mixed":
        return rounding
    return "gptq" if fqn.rsplit(".", 1)[-1] in _MLP_NAMES else "imatrix"


def collect_stats(model: nn.Module, calibration: Iterable[Tensor], targets: dict[str, nn.Linear],
                  rounding: str, progress: bool = True) -> dict[str, Tensor]:
    """Calibration statistics for the targets: E[x xᵀ] where some layer's rounding is GPTQ, else only
    the diagonal E[x²] (cheaper)."""
    from ..calibrate import collect_hessians
    full = any(rounding_for(rounding, f) == "gptq" for f in targets)
    return collect_hessians(model, calibration, targets, diagonal_only=not full, progress=progress)


def input_importance(stat: Tensor) -> Tensor:
    """E[x²] per input feature from a collect_stats entry (a Hessian's diagonal, or the diagonal itself)."""
    return torch.diagonal(stat) if stat.dim() == 2 else stat
