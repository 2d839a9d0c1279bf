"""End-to-end speed of a whole model, as users feel it: prefill tokens/s of a prompt and greedy decode
tokens/s at batch 1, for SmolLM2-135M in fp32, bf16 and low-bit formats, eager and compiled (static
KV cache, torch.compile fullgraph: torch_lowbit.generation.CompiledGenerator), next to llama.cpp on
the same GGUF file in the same run when llama-cpp-python is installed (the optional [peers] extra).
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from typing import Callable, Optional

import torch

from ..eval.assets import load_smollm2, smollm2_gguf
from ..eval.speed import model_nbytes, prompt_ids
from ..generation import CompiledGenerator

# gguf: SmolLM2's own file imported with its blocks (int4_g32 layers, q8_0 embedding/tied head): the
# weights llama.cpp runs. "F+E": format F for the Linear layers, E for the embedding and tied head.
E2E_VARIANTS = ("fp32", "bf16", "gguf", "q4_0+q8_0")
FLOAT_VARIANTS = ("fp32", "bf16", "gguf")
LLAMA_CPP_LABEL = "llama.cpp (GGUF Q4_1, Q8_0 embedding/head)"  # its row: the bundled GGUF file
LLAMA_CPP_MISSING = ("not installed (pip install 'torch_lowbit[peers]': builds llama.cpp from source, "
                     "~10-20 min)")
E2E_HEADERS = ["model", "mode", "size MB", "prefill tok/s", "decode tok/s", "prefill vs llama.cpp",
               "decode vs llama.cpp", "decode vs fp32 eager"]


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _median(values) -> float:
    return statistics.median(values)


def split_kv(name: str) -> tuple[str, Optional[int]]:
    """"q4_0@kv4" -> ("q4_0", 4): a variant generating on a 4- or 8-bit QuantizedKVCache."""
    model, sep, kv = name.partition("@kv")
    if not sep:
        return name, None
    if kv not in ("4", "8"):
        raise ValueError(f"e2e variant {name!r}: the KV cache suffix is @kv4 or @kv8")
    return model, int(kv)


def variant_formats(name: str) -> list[str]:
    """The format names a variant name uses (for checking them before any work)."""
    name, _ = split_kv(name)
    return [] if name in FLOAT_VARIANTS else name.split("+")


def _variant(name: str, base, tokenizer):
    """(model, label) of one variant: fp32 / bf16 copies of SmolLM2, the GGUF file imported, or the
    fp32 model quantized (RTN) to a format name, "+E": the embedding and tied head to format E."""
    from ..io import from_gguf
    from ..nn import quantize_, quantize_embeddings_
    if name == "fp32":
        return base, "fp32"
    if name == "bf16":
        return copy.deepcopy(base).to(torch.bfloat16), "bf16"
    if name == "gguf":
        return from_gguf(smollm2_gguf())[0], "GGUF import: int4_g32 + q8_0 embedding/head"
    fmt, _, embedding = name.partition("+")
    model = quantize_(copy.deepcopy(base), fmt, progress=False)
    if embedding:
        quantize_embeddings_(model, embedding)
    return model, fmt + (f" + {embedding} embedding/head" if embedding else "")


def _time_torch(model, ids: torch.Tensor, new_tokens: int, compiled: bool, repeats: int,
                kv_bits: Optional[int] = None) -> tuple[float, float, float]:
    """(prefill tok/s, decode tok/s, compile-and-first-run seconds) of CompiledGenerator, medians."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = CompiledGenerator(model, max_cache_len=ids.shape[1] + new_tokens + 8, compile=compiled, kv_bits=kv_bits,
                            kv_group=min(64, head_dim), kv_residual=0)  # QuaRot's cache: every token rounded
    t0 = time.perf_counter()
    gen.generate(ids, new_tokens)  # compiles (or warms up eager kernels)
    first = time.perf_counter() - t0
    prefill, decode = [], []
    for _ in range(repeats):
        gen.generate(ids, new_tokens)
        prefill.append(gen.times.prefill_tokens_per_s)
        decode.append(gen.times.decode_tokens_per_s)
    return _median(prefill), _median(decode), first


def time_llama_cpp(ids: list[int], new_tokens: int, threads: int, repeats: int) -> tuple[list, list]:
    """(prefill tok/s, decode tok/s) of each of `repeats` runs of llama.cpp on the bundled GGUF, same
    token ids, greedy."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(smollm2_gguf()), n_ctx=len(ids) + new_tokens + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=max(512, len(ids)), verbose=False)
    prefill, decode = [], []
    for i in range(repeats + 1):  # the first run warms up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([llm.sample(temp=0.0)])
        t2 = time.perf_counter()
        if i:
            prefill.append(len(ids) / (t1 - t0))
            decode.append((new_tokens - 1) / (t2 - t1))
    return prefill, decode


def bench_e2e(variants=E2E_VARIANTS, *, prompt_tokens: int = 256, new_tokens: int = 64, threads: int = 2,
              repeats: int = 3, modes=("eager", "compiled"), peers: bool = True,
              progress: Optional[Callable[[str], None]] = None) -> tuple[list[list[str]], dict]:
    """Rows [model, mode, size MB, prefill tok/s, decode tok/s, prefill and decode vs llama.cpp, decode vs
    fp32 eager] (llama.cpp: timed before and after ours, the median of both sets of runs)
    and a dict of run facts (threads, prompt, llama.cpp version or why it is missing)."""
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    torch.set_num_threads(threads)
    base, tok = load_smollm2()
    ids = prompt_ids(tok, prompt_tokens)
    facts = {"threads": threads, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats}
    results = []  # (label, mode, MB, prefill, decode)
    peer_runs = None
    if peers and llama_cpp_available():
        import llama_cpp
        peer_runs = time_llama_cpp(ids[0].tolist(), new_tokens, threads, repeats)
        facts["llama.cpp"] = f"llama-cpp-python {llama_cpp.__version__}"
        progress(f"  llama.cpp (first of two times): prefill {_median(peer_runs[0]):.1f} tok/s, decode "
                 f"{_median(peer_runs[1]):.1f} tok/s")
    else:
        facts["llama.cpp"] = LLAMA_CPP_MISSING if peers else "not asked"
    for name in variants:
        name, kv_bits = split_kv(name)
        model, label = _variant(name, base, tok)
        label += f", {kv_bits}-bit KV cache" if kv_bits else ""
        mb = model_nbytes(model)["total"] / 1e6
        for mode in modes:
            p, d, first = _time_torch(model, ids, new_tokens, mode == "compiled", repeats, kv_bits)
            results.append((label, mode, mb, p, d))
            progress(f"  {label} {mode}: prefill {p:.1f} tok/s, decode {d:.1f} tok/s (first run {first:.0f} s)")
        del model
    if peer_runs is not None:  # timed again after ours, so a slow or fast phase of a shared machine hits both
        again = time_llama_cpp(ids[0].tolist(), new_tokens, threads, repeats)
        progress(f"  llama.cpp (second time): prefill {_median(again[0]):.1f} tok/s, decode {_median(again[1]):.1f} tok/s")
        results.insert(0, (LLAMA_CPP_LABEL, "llama.cpp",
                           smollm2_gguf().stat().st_size / 1e6, _median(peer_runs[0] + again[0]),
                           _median(peer_runs[1] + again[1])))
        facts["llama.cpp runs"] = {"first": peer_runs, "second": again}
    peer = next((r for r in results if r[1] == "llama.cpp"), None)
    fp32 = next((r for r in results if r[0] == "fp32" and r[1] == "eager"), None)
    rows = []
    for label, mode, mb, p, d in results:
        rows.append([label, mode, f"{mb:.1f}", f"{p:.1f}", f"{d:.1f}", f"{p / peer[3]:.2f}x" if peer else "-",
                     f"{d / peer[4]:.2f}x" if peer else "-", f"{d / fp32[4]:.2f}x" if fp32 else "-"])
    return rows, facts
