"""The native decoder: a whole forward step of a Llama-family causal LM in C++ (csrc/native_decoder.cpp)
over the model's own quantized buffers, for generation on the CPU without a compiled graph.

`native_decoder(model)` reads the model's structure (facts, not names: decoder blocks of RMSNorm,
q/k/v/o projections (per-head q/k RMSNorms allowed) with rotary embeddings and grouped-query
attention, a SiLU-gated MLP; every
projection a QuantLinear whose CPU forward is one lut_i8_linear call, or a float32 nn.Linear), hands
the C++ decoder references to the same tensors (no copy of the weights), and then runs a short
probe through both the decoder and the model's own forward: only a decoder whose logits match is
returned. Otherwise the reason is returned, for CompiledGenerator's one log line.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .layouts.lut_i8 import int8_table
from .nn.embedding import QuantEmbedding
from .nn.fusion import ProjectionSlot
from .nn.linear import QuantLinear
from .ops.extension import cpu_extension, has_cpu_extension

# The probe: the decoder's logits must match the model's within this fraction of their largest
# magnitude, or within 4x the most the model itself moves when its input embeddings are scaled by
# 1 + n for n in PROBE_NUDGES, if that is more. Both sides run the same kernels, but fp32 summation
# order (norms, attention) differs in the last bits, and activations that sit on an int8 rounding tie
# (rows of a q8_0 embedding after the first norm) then round the other way; deeper layers spread that
# to ~1-2% of the logits' scale on SmolLM2, as any input noise does. One nudge can miss every tie
# (a random 2-layer model then stood 0.28% off against a 0.2% floor), so three, and a 0.5% floor. A
# different architecture (norm weights + 1, scaled embeddings, another activation) is off by O(1).
PROBE_TOLERANCE = 5e-3
PROBE_NUDGES = (1e-5, -1e-5, 3e-5)
PROBE_TOKENS = 8

_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_norm", "k_norm"}
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "act_fn", "activation_fn"}  # Phi-3: activation_fn


class Unsupported(Exception):
    """Why the native decoder cannot run this model (a fact about it)."""


def _eps(norm: nn.Module, where: str) -> float:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(eps, float) or not isinstance(getattr(norm, "weight", None), Tensor):
        raise Unsupported(f"{where} is not an RMSNorm with a weight and an epsilon ({type(norm).__name__})")
    return eps


def _projection(core, module: nn.Module, where: str) -> int:
    """The decoder's id for a projection module."""
    if isinstance(module, QuantLinear):
        bufs = module._buffers
        args = module.layout.lut_i8_args(module.fmt, {n: bufs[n] for n in module._kernel_buffer_names})
        if args is None:
            raise Unsupported(f"{where}: layout {module.layout.name} ({module.fmt.name}) has no native kernel "
                              "(the lut_i8 layouts do)")
        qweight, scales, mins, lut, bits, group, sub_groups, sub_scales, sub_mins = args
        return core.add_quant_linear(qweight, scales, mins, lut, bits, group, module.out_features, bufs["bias"],
                                     sub_groups, sub_scales, sub_mins)
    if type(module) is nn.Linear and module.weight.dtype == torch.float32:
        return core.add_dense_linear(module.weight.detach(), None if module.bias is None else module.bias.detach())
    raise Unsupported(f"{where}: {type(module).__name__} is neither a QuantLinear nor a float32 nn.Linear")


def _projections(core, parent: nn.Module, names: tuple, fused: str, where: str) -> list[int]:
    if isinstance(getattr(parent, fused, None), nn.Module):  # fused q/k/v or gate/up (nn/fusion.py)
        return [_projection(core, getattr(parent, fused), f"{where}.{fused}")]
    mods = [getattr(parent, n, None) for n in names]
    if any(m is None or isinstance(m, ProjectionSlot) for m in mods):
        raise Unsupported(f"{where} lacks one of {', '.join(names)}")
    return [_projection(core, m, f"{where}.{n}") for n, m in zip(names, mods)]


def _check_config(cfg, max_cache_len: int) -> None:
    act = getattr(cfg, "hidden_act", None)
    if act not in ("silu", "swish"):
        raise Unsupported(f"hidden_act {act!r} (the native decoder's MLP is SiLU-gated)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None) is not None:
            raise Unsupported(f"{key} is set")
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    window = getattr(cfg, "sliding_window", None)
    if kinds != {"full_attention"} or (window is not None and getattr(cfg, "use_sliding_window", True)
                                       and window < max_cache_len):
        raise Unsupported("sliding-window attention")


class NativeDecoder:
    """The C++ decoder of one model and the embedding it reads; `bind(cache)` before calling."""

    def __init__(self, model: nn.Module, core, embed: nn.Module, positions: int):
        self.model, self.core, self.embed, self.positions = model, core, embed, positions
        self.embed_in_core = _embedding_in_core(core, embed)

    def bind(self, cache) -> None:
        """Write keys and values into `cache` (a transformers StaticCache of fp32 layers)."""
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) != self.core.blocks:
            raise Unsupported("the cache is not a StaticCache with one layer per block")
        try:
            self.core.bind_cache([layer.keys for layer in layers], [layer.values for layer in layers])
        except (RuntimeError, AttributeError) as e:
            raise Unsupported(f"the cache's tensors: {e}") from None

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, position: int) -> Tensor:
        """Logits [batch, vocab] of the last of input_ids' tokens, which sit at positions position,
        position + 1, ... (their keys and values go into the bound cache)."""
        if self.embed_in_core:  # the rows looked up in C++ (a lut_i8 QuantEmbedding)
            return self.core.forward_ids(input_ids, int(position))
        embeds = self.embed(input_ids)
        if embeds.dtype != torch.float32:
            embeds = embeds.float()
        return self.core.forward(embeds.contiguous(), int(position))


def _embedding_in_core(core, embed: nn.Module) -> bool:
    """Hands the decoder a QuantEmbedding's lut_i8 rows (a Python lookup costs ~0.1 ms a token); False
    where the module's own lookup runs instead."""
    if not isinstance(embed, QuantEmbedding) or embed.out_dtype != torch.float32 or embed.scale != 1.0:
        return False  # a scaled embedding (Gemma) keeps the module's own lookup
    table = int8_table(embed.fmt) if hasattr(embed.fmt, "code_values") else None
    args = None if table is None else embed.layout.lut_i8_args(embed.fmt, {**embed.packed, "lut_i8": table})
    if args is None or any(a is not None for a in args[6:]):  # not lut_i8 tiles; per-row codebooks or sub-scales
        return False
    qweight, scales, mins, lut, bits, group = args[:6]
    core.set_embedding(qweight, scales, mins, lut, bits, group, embed.num_embeddings)
    return True


def _is_identity(module: nn.Module) -> bool:
    """A child that does nothing at inference (Phi-3's residual dropouts in eval mode, nn.Identity)."""
    return isinstance(module, nn.Identity) or (isinstance(module, nn.Dropout) and not module.training)


def _build(model: nn.Module, max_cache_len: int) -> NativeDecoder:
    if not has_cpu_extension() or not hasattr(cpu_extension(), "NativeDecoder"):
        raise Unsupported("the C++ extension is not built")
    if any(t.device.type != "cpu" for t in model.parameters()) or any(t.device.type != "cpu" for t in model.buffers()):
        raise Unsupported("the model is not on the CPU")
    cfg = model.config.get_text_config()
    _check_config(cfg, max_cache_len)
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or head is None:
        raise Unsupported("no decoder blocks (model.model.layers) or LM head (model.lm_head)")
    for name in ("embed_tokens", "norm", "rotary_emb"):
        if not isinstance(getattr(base, name, None), nn.Module):
            raise Unsupported(f"no model.model.{name}")
    attn0, mlp0 = getattr(layers[0], "self_attn", None), getattr(layers[0], "mlp", None)
    head_dim = getattr(attn0, "head_dim", None)
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    intermediate = getattr(cfg, "intermediate_size", None)
    if not isinstance(head_dim, int) or mlp0 is None or not isinstance(intermediate, int):
        raise Unsupported("the first block has no attention head_dim or MLP")
    scale = getattr(attn0, "scaling", head_dim ** -0.5)
    core = cpu_extension().NativeDecoder(cfg.hidden_size, heads, kv_heads, head_dim, intermediate, float(scale))
    for i, layer in enumerate(layers):
        where = f"model.layers.{i}"
        extra = {n for n, m in layer.named_children() if not _is_identity(m)} - _LAYER_CHILDREN
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if extra or attn is None or mlp is None:
            raise Unsupported(f"{where} has modules other than attention, MLP and two norms: {sorted(extra)}")
        extra = ({n for n, _ in attn.named_children()} - _ATTENTION_CHILDREN) | \
                ({n for n, _ in mlp.named_children()} - _MLP_CHILDREN)
        if extra:  # routers, experts, ...
            raise Unsupported(f"{where}: unknown attention / MLP parts {sorted(extra)}")
        act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
        if "SiLU" not in type(act).__name__:
            raise Unsupported(f"{where}.mlp's activation is not SiLU")
        if getattr(attn, "scaling", scale) != scale or getattr(attn, "head_dim", head_dim) != head_dim:
            raise Unsupported(f"{where}: attention scaling or head_dim differs from the first block's")
        core.add_block(layer.input_layernorm.weight.detach(), _eps(layer.input_layernorm, f"{where}.input_layernorm"),
                       layer.post_attention_layernorm.weight.detach(),
                       _eps(layer.post_attention_layernorm, f"{where}.post_attention_layernorm"),
                       _projections(core, attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj", f"{where}.self_attn"),
                       [_projection(core, attn.o_proj, f"{where}.self_attn.o_proj")],
                       _projections(core, mlp, ("gate_proj", "up_proj"), "gate_up_proj", f"{where}.mlp"),
                       [_projection(core, mlp.down_proj, f"{where}.mlp.down_proj")])
        norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
        if any(n is not None for n in norms):  # per-head RMSNorms before rotary (Qwen3)
            if any(n is None or getattr(n, "weight", None) is None or n.weight.shape != (head_dim,) for n in norms):
                raise Unsupported(f"{where}: q_norm / k_norm are not both RMSNorms over head_dim")
            q, k = norms
            core.set_qk_norms(q.weight.detach(), _eps(q, f"{where}.self_attn.q_norm"), k.weight.detach(),
                              _eps(k, f"{where}.self_attn.k_norm"))
    core.set_head(base.norm.weight.detach(), _eps(base.norm, "model.norm"), [_projection(core, head, "lm_head")])
    # the model's own rotary embedding (its scaling, e.g. llama3's, included) at every cache position
    positions = torch.arange(max_cache_len).unsqueeze(0)
    cos, sin = base.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    core.set_rotary(cos[0].float().contiguous(), sin[0].float().contiguous())
    return NativeDecoder(model, core, base.embed_tokens, max_cache_len)


class _ProbeCache:
    """A StaticCache stand-in for the probe: layers with fp32 keys and values of a few positions."""

    class Layer:
        def __init__(self, shape):
            self.keys, self.values = torch.zeros(shape), torch.zeros(shape)

    def __init__(self, blocks: int, kv_heads: int, length: int, head_dim: int):
        self.layers = [self.Layer((1, kv_heads, length, head_dim)) for _ in range(blocks)]


@torch.no_grad()
def _probe(decoder: NativeDecoder, model: nn.Module) -> None:
    """The decoder's last-position logits of a PROBE_TOKENS-token prompt (as one prefill, then as a
    prefill and a decode step) against the model's own forward."""
    cfg = model.config.get_text_config()
    head = model.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or cfg.vocab_size
    ids = (torch.arange(PROBE_TOKENS) * 7919 + 11).remainder(vocab).unsqueeze(0)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    decoder.bind(_ProbeCache(decoder.core.blocks, kv_heads, PROBE_TOKENS, model.model.layers[0].self_attn.head_dim))
    whole = decoder(ids, 0)
    decoder(ids[:, :-1], 0)
    stepped = decoder(ids[:, -1:], PROBE_TOKENS - 1)
    want = model(input_ids=ids, use_cache=False).logits[:, -1].float()
    embeds = decoder.embed(ids)
    moved = max(float((model(inputs_embeds=embeds * (1 + n), use_cache=False).logits[:, -1].float() - want).abs().max())
                for n in PROBE_NUDGES)
    scale = float(want.abs().max()) or 1.0
    tolerance = max(PROBE_TOLERANCE, 4 * moved / scale)
    for got, how in ((whole, "a prefill"), (stepped, "a decode step")):
        err = float((got - want).abs().max()) / scale
        if not err <= tolerance:  # NaN fails too
            raise Unsupported(f"its logits of {how} differ from the model's forward by {err:.2g} of their "
                              f"largest (tolerance {tolerance:.2g}): an architecture it does not know")


def native_decoder(model: nn.Module, max_cache_len: int) -> tuple[Optional[NativeDecoder], Optional[str]]:
    """(decoder, None) for a model the native decoder runs exactly, else (None, why not)."""
    try:
        decoder = _build(model, max_cache_len)
        _probe(decoder, model)
        return decoder, None
    except Unsupported as e:
        return None, str(e)
