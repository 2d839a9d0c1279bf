"""Llama-shaped GGUF files with random weights for `bench e2e` (speed only, never quality): the linear
weights N(0, std) in Q4_0 or Q2_K blocks, the tied embedding/head in Q8_0, SmolLM2's tokenizer
copied from the bundled GGUF (its 49152 tokens: the same prompt ids work), written with gguf's
writer one tensor at a time (the 1B files are 0.4-0.7 GB) and cached under cache_dir()/bench, keyed by the
recipe: a changed recipe writes a new file and removes the old one.

gguf's Python quantizer writes Q4_0 and Q8_0 but not Q2_K (it only dequantizes K-quants), so Q2_K
blocks come from q2_k_blocks below: a plain round-to-nearest encoder of llama.cpp's block_q2_K
layout (llama.cpp's own quantizer searches each sub-block's scale and min; this one does not).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..core.cache import cache_dir
from .model_shapes import LLAMA_1B

WRITER_VERSION = 1  # part of every recipe's key: a change to what the writer puts in a file rewrites it
LINEAR_TYPES = ("Q4_0", "Q2_K")
QK_K = 256  # weights per Q2_K super-block: 16 sub-blocks of 16
SMOLLM2_VOCAB = 49152


@dataclass(frozen=True)
class GGUFRecipe:
    """What a benchmark GGUF file holds. shape: LlamaConfig keyword arguments (model_shapes)."""
    name: str
    shape: dict = field(hash=False)
    linear_type: str = "Q4_0"
    embedding_type: str = "Q8_0"
    std: float = 0.02
    seed: int = 0

    def key(self) -> str:
        text = json.dumps({**asdict(self), "writer": WRITER_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def path(self) -> Path:
        return cache_dir() / "bench" / f"{self.name}-{self.key()}.gguf"


LLAMA_1B_RECIPES = (GGUFRecipe("llama-1b-q4_0", LLAMA_1B, "Q4_0"), GGUFRecipe("llama-1b-q2_k", LLAMA_1B, "Q2_K"))


def bench_gguf(recipe: GGUFRecipe, progress: Optional[Callable[[str], None]] = None) -> Path:
    """The recipe's GGUF file, written on first use (temp file + rename: never a half-written file
    under the final name); files of an earlier recipe of the same name are removed."""
    path = recipe.path()
    if path.is_file():
        return path
    if progress:
        progress(f"  writing {path} (once: random weights, {recipe.linear_type} linear blocks)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write_recipe(recipe, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    stale = re.compile(re.escape(recipe.name) + r"-[0-9a-f]{12}\.gguf")
    for old in path.parent.iterdir():
        if old != path and stale.fullmatch(old.name):
            old.unlink(missing_ok=True)
    return path


def write_recipe(recipe: GGUFRecipe, path: Path) -> None:
    """Writes the recipe's GGUF file at path: metadata as to_gguf writes it, SmolLM2's tokenizer keys,
    tensors generated and quantized one at a time (the 1B file never sits in memory)."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from ..eval.assets import smollm2_gguf
    from ..io.gguf import open_gguf, require_gguf, tensor_name_map
    from ..io.gguf_export import tokenizer_fields, write_metadata
    from .model_shapes import llama_config
    gguf = require_gguf()
    if recipe.linear_type not in LINEAR_TYPES:
        raise ValueError(f"recipe {recipe.name}: linear_type {recipe.linear_type!r}; choose from {LINEAR_TYPES}")
    config = llama_config(recipe.shape, SMOLLM2_VOCAB)
    with init_empty_weights():  # names and shapes only
        skeleton = LlamaForCausalLM(config)
    names = tensor_name_map("llama", config.num_hidden_layers)
    embedding, head = skeleton.get_input_embeddings().weight, skeleton.get_output_embeddings().weight
    plan = []  # (GGUF name, HF shape, GGUF type name or None for F32)
    for hf_name, p in skeleton.named_parameters():
        if p is head and config.tie_word_embeddings:
            continue  # no output.weight: llama.cpp and from_gguf use token_embd as the head
        kind = None if p.dim() == 1 else recipe.embedding_type if p is embedding else recipe.linear_type
        if kind == "Q2_K" and p.shape[1] % QK_K:
            raise ValueError(f"recipe {recipe.name}: {hf_name} has {p.shape[1]} inputs; Q2_K rows hold multiples "
                             f"of {QK_K}")
        plan.append((names.get_name(hf_name, try_suffixes=(".weight", ".bias")), tuple(p.shape), kind))

    writer = gguf.GGUFWriter(path, "llama")
    write_metadata(writer, config, gguf)
    writer.add_description(f"torch_lowbit bench recipe {recipe.key()}: random weights, speed only")
    for key, value, main, sub in tokenizer_fields(open_gguf(smollm2_gguf()), gguf):
        writer.add_key_value(key, value, main, sub_type=sub)
    for name, shape, kind in plan:
        if kind is None:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
            byte_shape = (shape[0], shape[1] // block * nbytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                                   raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    gen = torch.Generator().manual_seed(recipe.seed)
    for name, shape, kind in plan:
        if kind is None:  # RMSNorm weights
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
            continue
        w = (torch.randn(shape, generator=gen) * recipe.std).numpy()
        writer.write_tensor_data(q2_k_blocks(w) if kind == "Q2_K" else
                                 gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind]))
    writer.close()


def q2_k_blocks(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) -> uint8 [N, K/256 * 84]: llama.cpp's block_q2_K, each
    super-block of 256 = 16 sub-blocks of 16 weights, value = d * (sc & 15) * q - dmin * (sc >> 4) with
    q in 0..3; bytes: 16 scale bytes, 64 bytes of 2-bit codes, fp16 d, fp16 dmin. Round to nearest: each
    sub-block spans [min(x, 0), max(x)], its scale and min rounded to 4 bits of the super-block's."""
    rows, k = w.shape
    x = np.asarray(w, dtype=np.float32).reshape(-1, QK_K // 16, 16)  # super-block, sub-block, weight
    low = np.minimum(x.min(-1), 0.0)  # Q2_K subtracts a non-negative min
    step = (x.max(-1) - low) / 3
    d = (step.max(-1) / 15).astype(np.float16)
    dmin = (-low.min(-1) / 15).astype(np.float16)

    def four_bits(v, unit):
        unit = unit.astype(np.float32)[:, None]
        return np.clip(np.rint(np.divide(v, unit, out=np.zeros_like(v), where=unit > 0)), 0, 15).astype(np.uint8)

    sc, mn = four_bits(step, d), four_bits(-low, dmin)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.divide(x + offset[..., None], scale[..., None], out=np.zeros_like(x), where=scale[..., None] > 0)
    q = np.clip(np.rint(q), 0, 3).astype(np.uint8).reshape(-1, 2, 4, 32)  # half, shift, byte
    qs = (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)
    blocks = np.concatenate([sc | mn << 4, qs, d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8)],
                            axis=1)
    return blocks.reshape(rows, k // QK_K * 84)
