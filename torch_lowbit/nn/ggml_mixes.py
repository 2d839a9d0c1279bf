"""llama.cpp's K-quant mixes (Q4_K_M and friends) as per-layer plans for quantize_: which tensors get more
bits, following llama.cpp's llama_tensor_get_type for dense (non-MoE, non-Falcon) models, so a model
quantized with `quantize_(model, "q4_k_m")` has the same tensor types as `llama-quantize ... Q4_K_M`
gives.

The rules, per mix: a default K-quant for every linear layer; attention's V projection (or a fused
q/k/v) and the MLP's down projection in chosen layers get a bigger type; the LM head Q6_K. A layer
whose input width is not a multiple of 256 (the K-quant super-block) falls back as llama.cpp's
tensor_type_fallback does (q2_k / q3_k -> q4_0, q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0); the head of
such a width is q8_0.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

from torch import nn

SUPER_BLOCK = 256
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


# mix -> (default type, rule(category, i_layer, n_layers, n_gqa) -> type or None for the default)
Rule = Callable[[str, int, int, int], Optional[str]]


def _q2_k(cat: str, i: int, n: int, gqa: int) -> Optional[str]:
    if cat == "attn_v":
        return "q4_k" if gqa >= 4 else "q3_k"
    return "q3_k" if cat in ("ffn_down", "attn_output") else None


def _q3_k_m(cat: str, i: int, n: int, gqa: int) -> Optional[str]:
    if cat == "attn_v":
        return "q5_k" if i < 2 else "q4_k"
    if cat == "ffn_down":
        return "q5_k" if i < n // 16 else "q4_k"
    return "q4_k" if cat == "attn_output" else None


def _q4_k_s(cat: str, i: int, n: int, gqa: int) -> Optional[str]:
    if cat == "attn_v" and i < 4:
        return "q5_k"
    return "q5_k" if cat == "ffn_down" and i < n // 8 else None


def _more_bits_q6_k(cat: str, i: int, n: int, gqa: int) -> Optional[str]:  # Q4_K_M and Q5_K_M
    return "q6_k" if cat in ("attn_v", "ffn_down") and use_more_bits(i, n) else None


MIXES: dict[str, tuple[str, Rule]] = {
    "q2_k": ("q2_k", _q2_k),
    "q3_k_m": ("q3_k", _q3_k_m),
    "q4_k_s": ("q4_k", _q4_k_s),
    "q4_k_m": ("q4_k", _more_bits_q6_k),
    "q5_k_m": ("q5_k", _more_bits_q6_k),
    "q6_k": ("q6_k", lambda cat, i, n, gqa: None),
}

# the mixes quantize_ takes by name: those whose names are not also formats (q2_k, q6_k)
NAMED_MIXES = tuple(m for m in MIXES if m.endswith(("_m", "_s")))

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _category(fqn: str) -> str:
    leaf = fqn.rsplit(".", 1)[-1]
    if leaf in ("v_proj", "qkv_proj"):  # llama.cpp treats a fused q/k/v as attention's V
        return "attn_v"
    return {"down_proj": "ffn_down", "o_proj": "attn_output"}.get(leaf, "other")


def ggml_mix_plan(model: nn.Module, mix: str) -> dict[str, str]:
    """{fqn: format name} for every nn.Linear of a transformers causal LM (the LM head included) under
    llama.cpp's mix `mix` (MIXES: q2_k, q3_k_m, q4_k_s, q4_k_m, q5_k_m, q6_k), with its fallbacks for
    widths that are not a multiple of 256. Layers outside `model.layers.N` get the default type."""
    if mix not in MIXES:
        raise ValueError(f"unknown llama.cpp mix {mix!r}; choose one of {', '.join(MIXES)}")
    config = getattr(model, "config", None)
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n_layers, int):
        raise ValueError("a llama.cpp mix needs a transformers model whose config has num_hidden_layers")
    if getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None):
        raise ValueError("llama.cpp's mixes treat MoE models differently; this plan follows dense models only")
    heads = cfg.num_attention_heads
    gqa = heads // (getattr(cfg, "num_key_value_heads", None) or heads)
    default, rule = MIXES[mix]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plan = {}
    for fqn, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if m is head:  # llama.cpp: the output tensor Q6_K, or Q8_0 when its width is not whole super-blocks
            plan[fqn] = "q6_k" if m.in_features % SUPER_BLOCK == 0 else "q8_0"
            continue
        found = _LAYER.search(f".{fqn}")
        chosen = (rule(_category(fqn), int(found.group(1)), n_layers, gqa) if found else None) or default
        plan[fqn] = chosen if m.in_features % SUPER_BLOCK == 0 else FALLBACK[chosen]
    return plan
