"""Sampling the next token from the last position's logits, as transformers' `generate` does it
(its temperature, top-k and top-p warpers, in its order, then one multinomial draw), with the
argument checks CompiledGenerator and torch_lowbit.generate share."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

# transformers' GenerationConfig defaults, so a sampled call means the same on either route
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_K = 50
DEFAULT_TOP_P = 1.0


def check_sampling(temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
                   seed: Optional[int] = None, generator: Optional[torch.Generator] = None) -> None:
    """ValueError naming the fix for an argument no sampler can use (None: not given)."""
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or not math.isfinite(temperature) or temperature <= 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r} (greedy decoding, "
                         "the default when not sampling, needs no temperature)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be an int >= 0 (0 keeps every token), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if seed is not None and generator is not None:
        raise ValueError("pass seed or generator, not both (seed=S is generator=torch.Generator().manual_seed(S))")


@dataclass(frozen=True)
class Sampler:
    """Picks the next token of each row from [batch, vocab] logits: temperature, then top-k, then
    top-p (transformers' warpers), then a draw from `generator` (torch's global one if None)."""
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    generator: Optional[torch.Generator] = None

    @classmethod
    def build(cls, device: torch.device, *, temperature: Optional[float] = None, top_k: Optional[int] = None,
              top_p: Optional[float] = None, seed: Optional[int] = None,
              generator: Optional[torch.Generator] = None) -> "Sampler":
        check_sampling(temperature, top_k, top_p, seed, generator)
        if seed is not None:
            generator = torch.Generator(device).manual_seed(seed)
        if generator is not None and generator.device.type != torch.device(device).type:
            raise ValueError(f"the generator is on {generator.device}, the logits on {device}: "
                             f"build it with torch.Generator({str(device)!r})")
        return cls(DEFAULT_TEMPERATURE if temperature is None else float(temperature),
                   DEFAULT_TOP_K if top_k is None else top_k, DEFAULT_TOP_P if top_p is None else float(top_p),
                   generator)

    def __post_init__(self):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
        warpers = LogitsProcessorList()
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        object.__setattr__(self, "_warpers", warpers)

    def __call__(self, logits: Tensor) -> Tensor:
        """[batch, 1] token ids."""
        scores = self._warpers(None, logits.float())  # these warpers never read the ids
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator)
