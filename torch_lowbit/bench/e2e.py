"""End-to-end speed of a whole model, as users feel it: prefill tokens/s of a prompt and greedy decode
tokens/s at batch 1, for SmolLM2-135M in fp32, bf16 and low-bit formats, eager and compiled (static
KV cache, torch.compile fullgraph: torch_lowbit.generation.CompiledGenerator), next to llama.cpp on
the same GGUF file in the same run when llama-cpp-python is installed (the optional [peers] extra).
Each row also gives the weight bytes a decoded token reads and the bandwidth that makes at its
decode speed. time_section runs one table (llama.cpp before and after ours); e2e_gguf uses it for
any GGUF file.
"""
from __future__ import annotations

import copy
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..eval.assets import load_smollm2, smollm2_gguf
from ..eval.speed import decode_read_nbytes, model_nbytes, prompt_ids
from ..generation import CompiledGenerator

# gguf: SmolLM2's own file imported with its blocks (int4_g32 layers, q8_0 embedding/tied head): the
# weights llama.cpp runs. "F+E": format F for the Linear layers, E for the embedding and tied head.
E2E_VARIANTS = ("fp32", "bf16", "gguf", "q4_0+q8_0")
FLOAT_VARIANTS = ("fp32", "bf16", "gguf")
# weights read MB/token: a decode step's weight bytes (all but the input embedding's table, of which it
# reads one row); decode GB/s: those bytes x decode tok/s, to hold against the machine's read bandwidth.
E2E_HEADERS = ["model", "mode", "size MB", "prefill tok/s", "decode tok/s", "weights read MB/token", "decode GB/s",
               "prefill vs llama.cpp", "decode vs llama.cpp", "decode vs fp32 eager"]


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


# How CompiledGenerator runs a row: transformers' forward eagerly, its compiled steps, or the native
# decoder (torch_lowbit/native_decode.py; the default of CompiledGenerator on the CPU where it applies).
MODES = ("eager", "compiled", "native")


def _time_torch(model, ids: torch.Tensor, new_tokens: int, mode: str, repeats: int,
                kv_bits: Optional[int] = None, profile: Optional[dict] = None) -> Optional[tuple[float, float, float]]:
    """(prefill tok/s, decode tok/s, compile-and-first-run seconds) of CompiledGenerator in `mode`,
    medians; None where the native decoder cannot run the model (the generator's native_reason says why).
    profile: a dict to fill with native_decode_profile's parts (native mode)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    native = mode == "native"
    if native and kv_bits:
        return None
    gen = CompiledGenerator(model, max_cache_len=ids.shape[1] + new_tokens + 8, compile=mode != "eager",
                            kv_bits=kv_bits, kv_group=min(64, head_dim), kv_residual=0,  # QuaRot's cache: every token rounded
                            native=native)
    t0 = time.perf_counter()
    try:
        gen.generate(ids, new_tokens)  # compiles (or warms up eager kernels; probes the native decoder)
    except ValueError:
        if native and gen.native_reason:
            return None
        raise
    first = time.perf_counter() - t0
    prefill, decode = [], []
    for _ in range(repeats):
        gen.generate(ids, new_tokens)
        prefill.append(gen.times.prefill_tokens_per_s)
        decode.append(gen.times.decode_tokens_per_s)
    if profile is not None and native:
        profile.update(native_decode_profile(gen, ids, new_tokens))
    return _median(prefill), _median(decode), first


def native_decode_profile(gen: CompiledGenerator, ids: torch.Tensor, new_tokens: int) -> dict[str, float]:
    """Milliseconds per decoded token of a generator on the native decoder: the wall time of a decode step
    in the generate loop, and its parts: the projections (activation rounding and kernels), attention,
    the decoder's other C++ work (norms, rotary, cache writes, residuals, SiLU gate), and everything
    outside the C++ step (the Python loop, the embedding lookup, the argmax). Over 3 calls."""
    core, runs, decode_s = gen._native.core, 3, 0.0
    core.set_profiling(True)  # times the phases of one-token steps
    try:
        core.reset_phases()
        for _ in range(runs):
            gen.generate(ids, new_tokens)
            decode_s += gen.times.decode_s
        seconds = core.phase_seconds()
    finally:
        core.set_profiling(False)
    steps = (new_tokens - 1) * runs
    parts = [s / steps * 1e3 for s in seconds]
    wall = decode_s / steps * 1e3
    return {"wall": wall, "projections": parts[0], "attention": parts[1], "other C++": parts[2],
            "outside C++": wall - sum(parts)}


def time_llama_cpp(path: Path, ids: list[int], new_tokens: int, threads: int, repeats: int) -> tuple[list, list]:
    """(prefill tok/s, decode tok/s) of each of `repeats` runs of llama.cpp on the GGUF file at path,
    the same token ids, greedy."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + new_tokens + 8, n_threads=threads,
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


def llama_cpp_perplexity(path: Path, ids, ctx: int, threads: int) -> float:
    """llama.cpp's perplexity on the GGUF file at path over the token ids, with the windows and NLL of
    eval.perplexity (non-overlapping windows of ctx, every next token scored), so it compares with ours
    number for number (llama.cpp's own tool scores only the second half of each window)."""
    import llama_cpp
    import numpy as np

    from ..eval.perplexity import window_nll, windows
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=ctx, n_batch=ctx, n_threads=threads, n_threads_batch=threads,
                          logits_all=True, verbose=False)
    nll, count = 0.0, 0
    for window in windows(torch.as_tensor(ids), ctx):
        llm.reset()
        llm.eval(window.tolist())
        logits = torch.from_numpy(np.array(llm.scores[:ctx], dtype=np.float32))
        nll += window_nll(logits, window)
        count += ctx - 1
    return math.exp(nll / count)


def llama_cpp_fact(peers: bool) -> str:
    """What the llama.cpp rows are: its version, or why they are missing."""
    if not peers:
        return "not asked"
    if not llama_cpp_available():
        return "not installed (pip install 'torch_lowbit[peers]': builds llama.cpp from source, ~10-20 min)"
    import llama_cpp
    return f"llama-cpp-python {llama_cpp.__version__}"


@dataclass
class Result:
    label: str
    mode: str
    size_mb: float
    read_bytes: int  # weight bytes per decoded token
    prefill: float  # tok/s
    decode: float  # tok/s


@dataclass
class Peer:
    """llama.cpp on a GGUF file: its row label and decode weight bytes per token."""
    path: Path
    label: str
    read_bytes: int


# A variant: () -> (model, row label, KV cache bits or None); called when its rows are timed.
Variant = Callable[[], tuple]


@dataclass
class GGUFTypes:
    """The tensor types of a GGUF file's weights: linear (most common first), embedding, head (None:
    tied to the embedding)."""
    linear: list[str]
    embedding: str
    head: Optional[str]

    def describe(self) -> str:
        head = "embedding/head" if self.head is None else f"embedding, {self.head} head"
        return f"{'/'.join(self.linear)}, {self.embedding} {head}"


def gguf_types(reader) -> GGUFTypes:
    """The weight types of an open GGUF file (gguf.GGUFReader)."""
    from collections import Counter
    by_name = {t.name: t.tensor_type.name for t in reader.tensors}
    linear = Counter(t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    return GGUFTypes([k for k, _ in linear.most_common()], by_name.get("token_embd.weight", "?"),
                     by_name.get("output.weight"))


def gguf_decode_read_nbytes(reader) -> int:
    """Weight bytes llama.cpp reads per decoded token from an open GGUF file: every tensor, but one row
    of token_embd when the file has its own output.weight (a tied head reads token_embd in full)."""
    total = sum(int(t.n_bytes) for t in reader.tensors)
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None or not any(t.name == "output.weight" for t in reader.tensors):
        return total
    rows = int(embedding.shape[1])  # ggml shape [hidden, vocab]
    return total - int(embedding.n_bytes) + int(embedding.n_bytes) // rows


def peer_of(path: Path) -> Peer:
    """llama.cpp's row on a GGUF file: its label names the file's types."""
    from ..io.gguf import open_gguf
    reader = open_gguf(path)
    return Peer(Path(path), f"llama.cpp (GGUF {gguf_types(reader).describe()})", gguf_decode_read_nbytes(reader))


def time_section(variants: Sequence[Variant], ids: torch.Tensor, peer: Optional[Peer], *, new_tokens: int,
                 threads: int, repeats: int, modes=MODES, progress: Callable[[str], None],
                 facts: dict, profile: bool = False) -> list[Result]:
    """Each variant in each mode through CompiledGenerator; llama.cpp on peer.path (None: no llama.cpp
    rows) timed before and after ours, the median of both sets of runs (put in facts["llama.cpp runs"])."""
    torch.set_num_threads(threads)
    results = []
    peer_runs = time_llama_cpp(peer.path, ids[0].tolist(), new_tokens, threads, repeats) if peer else None
    if peer_runs:
        progress(f"  llama.cpp (first of two times): prefill {_median(peer_runs[0]):.1f} tok/s, decode "
                 f"{_median(peer_runs[1]):.1f} tok/s")
    for make in variants:
        model, label, kv_bits = make()
        label += f", {kv_bits}-bit KV cache" if kv_bits else ""
        mb, read = model_nbytes(model)["total"] / 1e6, decode_read_nbytes(model)
        for mode in modes:
            parts = {} if profile else None
            timed = _time_torch(model, ids, new_tokens, mode, repeats, kv_bits, parts)
            if timed is None:
                progress(f"  {label} {mode}: no row (the native decoder does not run this variant)")
                continue
            p, d, first = timed
            results.append(Result(label, mode, mb, read, p, d))
            progress(f"  {label} {mode}: prefill {p:.1f} tok/s, decode {d:.1f} tok/s (first run {first:.0f} s)")
            if parts:
                progress(f"  {label} {mode}, a decode step (ms/token): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
        del model
    if peer_runs:  # timed again after ours, so a slow or fast phase of a shared machine hits both
        again = time_llama_cpp(peer.path, ids[0].tolist(), new_tokens, threads, repeats)
        progress(f"  llama.cpp (second time): prefill {_median(again[0]):.1f} tok/s, decode {_median(again[1]):.1f} tok/s")
        results.insert(0, Result(peer.label, "llama.cpp", peer.path.stat().st_size / 1e6, peer.read_bytes,
                                 _median(peer_runs[0] + again[0]), _median(peer_runs[1] + again[1])))
        facts["llama.cpp runs"] = {"first": peer_runs, "second": again}
    return results


def format_rows(results: Sequence[Result], vs_fp32: bool = True) -> list[list[str]]:
    """E2E_HEADERS rows (vs_fp32=False: without the last column, for tables with no fp32 row)."""
    peer = next((r for r in results if r.mode == "llama.cpp"), None)
    fp32 = next((r for r in results if r.label == "fp32" and r.mode == "eager"), None)
    rows = []
    for r in results:
        row = [r.label, r.mode, f"{r.size_mb:.1f}", f"{r.prefill:.1f}", f"{r.decode:.1f}", f"{r.read_bytes / 1e6:.1f}",
               f"{r.read_bytes * r.decode / 1e9:.2f}", f"{r.prefill / peer.prefill:.2f}x" if peer else "-",
               f"{r.decode / peer.decode:.2f}x" if peer else "-"]
        rows.append(row + ([f"{r.decode / fp32.decode:.2f}x" if fp32 else "-"] if vs_fp32 else []))
    return rows


def bench_e2e(variants=E2E_VARIANTS, *, prompt_tokens: int = 256, new_tokens: int = 64, threads: int = 2,
              repeats: int = 3, modes=MODES, peers: bool = True, profile: bool = False,
              progress: Optional[Callable[[str], None]] = None) -> tuple[list[list[str]], dict]:
    """SmolLM2-135M: E2E_HEADERS rows of each variant (fp32, bf16, gguf: its bundled GGUF imported, F or
    F+E; each with @kv4 / @kv8) and llama.cpp on the bundled GGUF, and a dict of run facts (threads,
    prompt, llama.cpp version or why it is missing)."""
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    torch.set_num_threads(threads)
    base, tok = load_smollm2()
    ids = prompt_ids(tok, prompt_tokens)
    facts = {"threads": threads, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats,
             "llama.cpp": llama_cpp_fact(peers)}
    peer = peer_of(smollm2_gguf()) if peers and llama_cpp_available() else None

    def variant(spec: str) -> Variant:
        name, kv_bits = split_kv(spec)
        return lambda: (*_variant(name, base, tok), kv_bits)

    results = time_section([variant(v) for v in variants], ids, peer, new_tokens=new_tokens, threads=threads,
                           repeats=repeats, modes=modes, progress=progress, facts=facts, profile=profile)
    return format_rows(results), facts
