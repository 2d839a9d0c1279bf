"""Perplexity with non-overlapping windows (the GPTQ / QuaRot protocol): tokenize the text once,
cut the first max_tokens into windows of ctx tokens, score each window independently, and report
exp(mean next-token NLL) over all predicted tokens.

kv_cache: a function returning a fresh transformers Cache for a window (e.g. a QuantizedKVCache):
each window then runs through it, so attention reads the cache's rounded keys and values as
QuaRot's KV-quantized evaluation does; default: no cache."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def windows(ids: torch.Tensor, ctx: int) -> list[torch.Tensor]:
    """The protocol's non-overlapping windows of ctx tokens of a 1-D id tensor (the tail dropped)."""
    if ctx < 2:
        raise ValueError(f"ctx must be at least 2, got {ctx}")
    n_windows = ids.numel() // ctx
    if n_windows == 0:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one window of ctx={ctx}")
    return [ids[w * ctx:(w + 1) * ctx] for w in range(n_windows)]


def window_nll(logits: torch.Tensor, window: torch.Tensor) -> float:
    """Summed next-token NLL of one window from its logits [ctx, vocab]: ctx - 1 predicted tokens."""
    return F.cross_entropy(logits[:-1].float(), window[1:].to(logits.device), reduction="sum").item()


@torch.no_grad()
def perplexity(model, tokenizer, text: str, ctx: int = 512, max_tokens: Optional[int] = None, *,
               progress: bool = True, kv_cache: Optional[Callable[[], object]] = None) -> float:
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for window in tqdm(windows(ids, ctx), desc="perplexity", disable=None if progress else True, leave=False):
        window = window.unsqueeze(0).to(device)
        if kv_cache is None:
            logits = model(window, use_cache=False).logits
        else:
            logits = model(window, past_key_values=kv_cache(), use_cache=True).logits
        nll += window_nll(logits[0], window[0])
        count += ctx - 1
    return math.exp(nll / count)
