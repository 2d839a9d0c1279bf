"""Model size, decode and prefill speed, as the main job, `eval` and `bench` report them."""
from __future__ import annotations

import time

import torch
from torch import nn

from ..nn import QuantLinear


def _storage_key(t: torch.Tensor) -> tuple:
    """Equal for tensors that are views of the same bytes (a tied head's weight and the embedding's)."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype


def model_nbytes(model: nn.Module) -> dict[str, int]:
    """Bytes of all parameters and persistent buffers (shared storage counted once), and of the
    Linear / QuantLinear weights alone."""
    seen, total, linear = set(), 0, 0
    for name, t in model.state_dict(keep_vars=True).items():
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            linear += m.weight_nbytes()
        elif isinstance(m, nn.Linear) and m is not getattr(model, "lm_head", None):
            linear += m.weight.numel() * m.weight.element_size()
    return {"total": total, "linear": linear}


def decode_read_nbytes(model: nn.Module) -> int:
    """Bytes of weights one decoded token reads: every parameter and persistent buffer once, except
    the input embedding's table, of which a token reads one row (a head tied to it reads all of it:
    counted under the head). Times decode tokens/s: the weight bandwidth a decode step draws."""
    embedding = model.get_input_embeddings()
    seen, total = set(), 0
    for m in model.modules():
        if m is embedding:
            continue
        own = list(m._parameters.values()) + [b for n, b in m._buffers.items()
                                                 if n not in m._non_persistent_buffers_set]
        for t in own:
            if t is not None and _storage_key(t) not in seen:
                seen.add(_storage_key(t))
                total += t.numel() * t.element_size()
    table = sum(t.numel() * t.element_size() for t in embedding.state_dict(keep_vars=True).values())
    return total + table // embedding.num_embeddings


@torch.no_grad()
def decode_tokens_per_s(model: nn.Module, tokenizer, *, new_tokens: int = 32, prompt: str | None = None,
                        repeats: int = 3) -> float:
    """Greedy decode speed (tokens/s, median of `repeats`) with the KV cache, batch 1."""
    prompt = prompt or "The history of the printing press begins"
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=tokenizer.eos_token_id)
    model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.generate(ids, **kwargs)
        times.append(time.perf_counter() - t0)
    times.sort()
    return new_tokens / times[len(times) // 2]


def prompt_ids(tokenizer, n_tokens: int = 128) -> torch.Tensor:
    """[1, n_tokens] token ids: the start of the bundled Wikipedia lead sections (real text), cut to
    exactly n_tokens."""
    from .assets import wiki_text
    ids = tokenizer(wiki_text(40), return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise ValueError(f"the prompt text has only {ids.shape[1]} tokens; ask for fewer prompt tokens")
    return ids


@torch.no_grad()
def prefill_tokens_per_s(model: nn.Module, ids: torch.Tensor, *, repeats: int = 5) -> float:
    """Prefill speed (prompt tokens/s, median of `repeats`): one eager forward pass over the whole
    prompt `ids` ([1, T]) filling a fresh KV cache, logits of the last position only (as generate's
    prefill)."""
    ids = ids.to(next(model.parameters()).device)
    model(input_ids=ids, use_cache=True, logits_to_keep=1)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    times.sort()
    return ids.shape[1] / times[len(times) // 2]
