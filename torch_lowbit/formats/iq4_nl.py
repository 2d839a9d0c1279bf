"""Non-uniform 4-bit table formats: iq4_nl (llama.cpp's IQ4_NL)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import torch
from torch import Tensor

from .registry import register_format
from .scalar import FixedBlockFormat

# llama.cpp's kvalues_iq4nl: a 16-level non-uniform grid fitted to the bell-shaped weight
# distribution (finer steps near zero), stored as int8.
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclasses.dataclass(frozen=True)
class IQ4_NL(FixedBlockFormat):
    """IQ4_NL: blocks of 32, fp16 scale d, value = d * kvalues[code] (same block bytes as ggml).

    Scale search as llama.cpp's quantize_row_iq4_nl_impl: candidates d = max / (kvalues[0] + 0.1 i),
    i in [-7, 7], each refit by weighted least squares on its codes; weights x² (data-free) or
    importance * sqrt(mean(x²) + x²) (with calibration, as llama.cpp's imatrix path).
    """

    kind: ClassVar[str] = "iq4_nl"

    def code_values(self) -> Tensor:
        return torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)

    def fit_groups(self, x: Tensor, importance: Optional[Tensor] = None) -> tuple[Tensor, None]:
        if importance is None:
            w = x * x
        else:
            w = importance.expand_as(x) * torch.sqrt((x * x).mean(-1, keepdim=True) + x * x)
        values = self.code_values().to(x.device)
        signed_max = x.gather(-1, x.abs().argmax(-1, keepdim=True))
        best_err, best = None, None
        for i in range(-7, 8):
            d = signed_max / (values[0] + 0.1 * i)
            t = values[self.encode(x, d, None).long()]
            wtt = (w * t * t).sum(-1, keepdim=True)
            refit = torch.where(wtt > 0, (w * t * x).sum(-1, keepdim=True) / wtt.clamp_min(1e-30), d)
            for cand in (d, refit):
                c16 = cand.half().float()  # judge the scale that will be stored
                err = (w * (values[self.encode(x, c16, None).long()] * c16 - x) ** 2).sum(-1, keepdim=True)
                if best is None:
                    best_err, best = err, c16
                else:
                    better = err < best_err
                    best_err, best = torch.where(better, err, best_err), torch.where(better, c16, best)
        return best, None


register_format(IQ4_NL())
