"""GGUF export: a (quantized) Hugging Face Llama / Qwen2 / Qwen3 model -> a llama.cpp GGUF file whose
q4_0 / iq4_nl / 4-bit asymmetric (int4_g*) / q8_0 layers are written as Q4_0 / IQ4_NL / Q4_1 / Q8_0
blocks holding exactly the module's codes and scales (the inverse of gguf.from_gguf)."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from torch import Tensor, nn

from ..nn.embedding import QuantEmbedding
from ..nn.linear import QuantLinear
from .gguf import open_gguf, qk_heads, require_gguf, tensor_name_map
from .gguf_arch import ARCHS, arch_of_model_type
from .gguf_blocks import encode_blocks, gguf_type_for, rope_rows

log = logging.getLogger(__name__)

_FLOAT_TYPES = {"f32": np.float32, "f16": np.float16}


def to_gguf(model: nn.Module, path: Union[str, os.PathLike], tokenizer=None, *,
            template: Union[None, str, os.PathLike] = None, other_formats: str = "error",
            float_type: str = "f32") -> Path:
    """Writes model (an HF Llama / Mistral / Qwen2 / Qwen3 causal LM, quantized or not) as a GGUF file.

    QuantLinear layers in q4_0, iq4_nl, int4_g32/g64/g128 (any 4-bit asymmetric group of 32k: Q4_1
    blocks repeat a group's scale and min) and q8_0 are written as GGUF blocks bit for bit; fused
    q/k/v and gate/up modules are split back into their tensors; llama's q/k rows are put in
    llama.cpp's rope order. Other QuantLinear formats: other_formats="error" (default) raises, "f32"
    / "f16" writes their dequantized weight. Float matrices are written as float_type ("f32"
    lossless, or "f16"); norms and biases always F32.
    Tokenizer: template= copies every tokenizer.* key from that GGUF file (e.g. the file the model
    came from); an HF tokenizer object is not converted (pass template instead). Returns the path.
    """
    gguf = require_gguf()
    if other_formats not in ("error", "f32", "f16"):
        raise ValueError(f"other_formats must be 'error', 'f32' or 'f16', got {other_formats!r}")
    if float_type not in _FLOAT_TYPES:
        raise ValueError(f"float_type must be 'f32' or 'f16', got {float_type!r}")
    if tokenizer is not None:
        raise ValueError("to_gguf does not convert Hugging Face tokenizers (llama.cpp picks its pre-tokenizer "
                         "by name); pass template=<a GGUF of the same tokenizer> to copy its tokenizer keys")
    config = getattr(model, "config", None)
    facts = arch_of_model_type(getattr(config, "model_type", None))
    if facts is None:
        raise ValueError(f"to_gguf writes Hugging Face models of type "
                         f"{', '.join(t for a in ARCHS.values() for t in a.model_types)}; this model's "
                         f"config has model_type {getattr(config, 'model_type', None)!r}")
    arch = facts.name
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if meta:
        raise ValueError(f"to_gguf: {meta[:3]} are on the meta device; load the weights first")
    tokenizer_keys = tokenizer_fields(open_gguf(template), gguf) if template is not None else []
    tokens = next((len(value) for key, value, *_ in tokenizer_keys if key == "tokenizer.ggml.tokens"), None)
    if tokens is not None and tokens != config.vocab_size:  # llama.cpp refuses such a file at load
        raise ValueError(f"to_gguf: the template's tokenizer has {tokens} tokens, the model's vocab_size is "
                         f"{config.vocab_size}; pass the GGUF file of this model's own tokenizer")
    name_map = tensor_name_map(arch, config.num_hidden_layers)

    def gguf_name(hf_name: str) -> str:
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"to_gguf: {hf_name} has no GGUF tensor name in architecture {arch}")
        return name

    def rope_order(name: str, t: Tensor) -> Tensor:
        heads = qk_heads(name, config, arch)
        return t if heads is None else t[rope_rows(t.shape[0], heads, to_gguf=True)]

    tensors: list[tuple[str, np.ndarray, Optional[str]]] = []  # (name, data, GGUF type of raw blocks)

    def add_float(name: str, t: Tensor, matrix_type=np.float32) -> None:
        data = rope_order(name, t.detach().float().cpu())
        if facts.norm_offset and facts.is_norm(name):
            data = data + facts.norm_offset  # Gemma's (1 + w) norms are stored as 1 + w
        tensors.append((name, data.numpy().astype(matrix_type if data.dim() > 1 else np.float32), None))

    fused = _fused_members(model)
    bad = []
    embedding_buffers = set()
    for fqn, m in model.named_modules():
        if isinstance(m, QuantEmbedding):
            type_name = gguf_type_for(m.fmt)
            if type_name is None:
                bad.append(f"{fqn} ({m.fmt.name})")
                continue
            q = {k: v.cpu() for k, v in m.layout.unpack(m.fmt, m.packed, m.num_embeddings, m.embedding_dim).items()}
            tensors.append((gguf_name(f"{fqn}.weight"), encode_blocks(m.fmt, q)[1], type_name))
            embedding_buffers.update(t.data_ptr() for t in m.packed.values())
    for fqn, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        if embedding_buffers and all(t.data_ptr() in embedding_buffers for t in m.packed.values()):
            continue  # a head tied to the quantized embedding: GGUF stores token_embd once, no output.weight
        members = fused.get(fqn, [fqn])
        sizes = m.split_sizes if fqn in fused else [m.out_features]
        type_name = gguf_type_for(m.fmt)
        if type_name is None and other_formats == "error":
            bad.append(f"{fqn} ({m.fmt.name})")
            continue
        whole = m.layout.unpack(m.fmt, m.packed, m.out_features, m.in_features) if type_name else m.dequantize()
        start = 0
        for member, n in zip(members, sizes):
            name = gguf_name(f"{member}.weight")
            if type_name:
                part = {k: rope_order(name, v[start:start + n].cpu()) for k, v in whole.items()}
                tensors.append((name, encode_blocks(m.fmt, part)[1], type_name))
            else:
                add_float(name, whole[start:start + n], _FLOAT_TYPES[other_formats])
            if m.bias is not None:
                add_float(gguf_name(f"{member}.bias"), m.bias[start:start + n])
            start += n
    if bad:
        raise ValueError(f"to_gguf: {len(bad)} layer(s) are in formats GGUF has no blocks for: {', '.join(bad[:4])}"
                         f"{' …' if len(bad) > 4 else ''}. GGUF holds q4_0, iq4_nl, int4_g32/64/128 (as Q4_1) and "
                         "q8_0; pass other_formats='f16' or 'f32' to write those layers dequantized")
    for name, p in model.named_parameters():  # each shared (tied) tensor once
        add_float(gguf_name(name), p.data, _FLOAT_TYPES[float_type])

    path = Path(os.fspath(path))
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    write_metadata(writer, config, gguf, skip={key for key, *_ in tokenizer_keys})
    for key, value, main, sub in tokenizer_keys:
        writer.add_key_value(key, value, main, sub_type=sub)
    for name, data, type_name in tensors:
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[type_name] if type_name else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, path)
    counts: dict[str, int] = {}
    for _, data, type_name in tensors:
        key = type_name or ("F16" if data.dtype == np.float16 else "F32")
        counts[key] = counts.get(key, 0) + 1
    log.info("to_gguf %s: %d tensors %s", path.name, len(tensors), counts)
    return path


def _fused_members(model: nn.Module) -> dict[str, list[str]]:
    """fused QuantLinear fqn -> the fqns of the projections it holds, in row order."""
    out = {}
    for pfqn, parent in model.named_modules():
        for names, fused_name in getattr(parent, "_lowbit_fusions", []):
            out[f"{pfqn}.{fused_name}" if pfqn else fused_name] = [f"{pfqn}.{n}" if pfqn else n for n in names]
    return out


def write_metadata(writer, config, gguf, skip=frozenset()) -> None:
    """The {arch}.* hyperparameters llama.cpp and transformers' GGUF loader read, and the config's special
    token ids (not those in `skip`: keys a template's tokenizer brings)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ValueError(f"to_gguf: rope type {rope_type!r} is not supported (only default and linear rope)")
    writer.add_name(str(getattr(config, "name_or_path", "") or config.model_type))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)  # always: a missing one is hidden / heads for llama.cpp, but Gemma's
    writer.add_value_length(head_dim)  # transformers config then falls back to its default of 256
    writer.add_rope_freq_base(float(theta))
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    if getattr(config, "sliding_window", None):  # Gemma 2/3 (transformers reads it; llama.cpp needs it)
        writer.add_sliding_window(int(config.sliding_window))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2
        if getattr(config, key, None) is not None:
            writer.add_float32(f"{writer.arch}.{key}", float(getattr(config, key)))
    writer.add_vocab_size(config.vocab_size)
    for key in ("pad", "bos", "eos"):  # the special token ids the config holds (a template's keys win)
        value = getattr(config, f"{key}_token_id", None)
        if isinstance(value, int) and f"tokenizer.ggml.{key}_token_id" not in skip:
            getattr(writer, f"add_{key}_token_id")(value)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def tokenizer_fields(reader, gguf) -> list[tuple]:
    """(key, value, type, array item type) of every tokenizer.* key of a GGUF file."""
    out = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            main = field.types[0]
            out.append((key, field.contents(), main, field.types[-1] if main == gguf.GGUFValueType.ARRAY else None))
    if not any(key == "tokenizer.ggml.model" for key, *_ in out):  # token ids alone are no tokenizer
        raise ValueError("to_gguf: the template GGUF has no tokenizer (no tokenizer.ggml.model key) to copy; pass "
                         "the GGUF file the tokenizer came from")
    return out
