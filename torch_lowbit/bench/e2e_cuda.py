"""End-to-end speed on a CUDA GPU: prefill tokens/s of a prompt and greedy decode tokens/s at batch 1
through CompiledGenerator (the decode step replayed from a CUDA graph), fp16 against low-bit formats
in their CUDA layouts, for SmolLM2-135M (its real weights) and a Llama-3.2-1B-shaped model (random
weights: speed only, never quality). The peer on a GPU is torch's own fp16 model (cuBLAS, SDPA).
"""
from __future__ import annotations

import copy
import sys
from typing import Callable, Optional

import torch

from ..eval.speed import model_nbytes, prompt_ids
from .e2e import _time_torch
from .model_shapes import LLAMA_1B, LLAMA_1B_VOCAB, llama_config

# TCQ formats are left out of the default: their Viterbi encoder runs on the CPU (SmolLM2 in tcq2_1mad
# takes minutes on 16 cores); name them with --formats.
CUDA_E2E_VARIANTS = ("fp16", "q4_0", "iq4_nl", "int2_g64")
CUDA_E2E_MODELS = ("smollm2", "llama-1b")
CUDA_E2E_HEADERS = ["model", "weights", "size MB", "prefill tok/s", "decode tok/s", "prefill vs fp16",
                    "decode vs fp16"]


def llama_1b_shaped(device: str = "cuda"):
    """A Llama-3.2-1B-shaped causal LM (16 layers, hidden 2048, MLP 8192, 32 query / 8 KV heads of 64,
    vocabulary 128256, tied embedding) with random weights, in fp16 on `device`."""
    from transformers import LlamaForCausalLM
    config = llama_config(LLAMA_1B, LLAMA_1B_VOCAB)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.float16)
    return model.eval()


def _base(name: str, device: str):
    """(fp16 model on device, tokenizer, label) of one benchmark model."""
    from ..eval.assets import load_smollm2
    if name not in CUDA_E2E_MODELS:
        raise ValueError(f"bench e2e --device cuda: unknown model {name!r}; choose from {CUDA_E2E_MODELS}")
    base, tok = load_smollm2()
    if name == "smollm2":
        return base.to(device, torch.float16), tok, "SmolLM2-135M"
    # llama-1b: SmolLM2's tokenizer gives the prompt ids (all below its 49152 vocabulary)
    return llama_1b_shaped(device), tok, "Llama-3.2-1B-shaped (random weights)"


@torch.no_grad()
def bench_e2e_cuda(variants=CUDA_E2E_VARIANTS, models=CUDA_E2E_MODELS, *, prompt_tokens: int = 512,
                   new_tokens: int = 64, repeats: int = 3, device: str = "cuda",
                   progress: Optional[Callable[[str], None]] = None) -> list[list[str]]:
    """Rows [model, weights, size MB, prefill tok/s, decode tok/s, both vs fp16] for each model x
    variant ("fp16" or a format name; the Linear layers quantized, RTN, the embedding and head fp16),
    compiled, decode from a CUDA graph, medians of `repeats` after a warm-up run."""
    from ..nn import quantize_
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench e2e --device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    rows = []
    for model_name in models:
        base, tok, label = _base(model_name, device)
        ids = prompt_ids(tok, prompt_tokens).to(device)
        results = []
        for name in variants:
            model = base if name == "fp16" else quantize_(copy.deepcopy(base), name, progress=False)
            p, d, first = _time_torch(model, ids, new_tokens, "compiled", repeats)
            results.append((name, model_nbytes(model)["total"] / 1e6, p, d))
            progress(f"  {label} {name}: prefill {p:.0f} tok/s, decode {d:.1f} tok/s (first run {first:.0f} s)")
            if model is not base:
                del model
        fp16 = next((r for r in results if r[0] == "fp16"), None)
        for name, mb, p, d in results:
            rows.append([label, name, f"{mb:.1f}", f"{p:.0f}", f"{d:.1f}", f"{p / fp16[2]:.2f}x" if fp16 else "-",
                         f"{d / fp16[3]:.2f}x" if fp16 else "-"])
        del base
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows
