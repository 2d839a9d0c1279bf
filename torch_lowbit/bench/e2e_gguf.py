"""`bench e2e` on GGUF files (--gguf PATH, and the Llama-3.2-1B-shaped files of gguf_recipe behind
--models llama-1b): llama.cpp on the file next to our import of the same file, eager and compiled.
Linear blocks from_gguf keeps (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q8_0, the K-quants Q2_K .. Q6_K) are
imported as they are and run by their kernels; --requantize FORMAT trades the non-32-weight-block ones
(K-quants and any type from_gguf does not keep) for FORMAT, as from_gguf(requantize=) does; --ppl's rows
always keep the file's blocks.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from ..eval.speed import prompt_ids
from ..formats import get_format
from .e2e import (E2E_HEADERS, E2E_VARIANTS, MODES, GGUFTypes, bench_e2e, format_rows, gguf_types, llama_cpp_available,
                  llama_cpp_fact, peer_of, time_section)

E2E_MODELS = ("smollm2", "llama-1b")
GGUF_E2E_HEADERS = E2E_HEADERS[:-1]  # no fp32 row to compare with
RANDOM_WEIGHTS = "random weights N(0, 0.02): speed only, never quality"
PPL_TOKENS, PPL_CTX = 2048, 512  # --ppl: the text and windows of docs' perplexity tables
PPL_HEADERS = ["model", "perplexity", "vs llama.cpp"]


def check_bench_gguf(path) -> GGUFTypes:
    """The file's weight types, or a one-line ValueError naming the fix: no file, not a readable GGUF,
    an architecture from_gguf does not import, or no tokenizer to make the prompt with."""
    from ..io.gguf import GGUFError, gguf_architecture, open_gguf
    path = Path(path)
    try:
        reader = open_gguf(path)
        gguf_architecture(reader, path)
    except FileNotFoundError as e:
        raise ValueError(f"{e}; pass the path of a llama.cpp .gguf model file") from e
    except GGUFError as e:
        raise ValueError(" ".join(str(e).split())) from e
    if "tokenizer.ggml.model" not in reader.fields:
        raise ValueError(f"{path} has no tokenizer.* metadata; bench e2e makes the prompt with the file's own "
                         "tokenizer: pass a GGUF converted with its tokenizer")
    return gguf_types(reader)


def import_plan(types: GGUFTypes, requantize: Optional[str] = None) -> str:
    """The row label of from_gguf's import of a file with these types (requantize: from_gguf's argument)."""
    from ..io.gguf import kept_format
    req = None if requantize is None else get_format(requantize)
    ours = [kept_format(k, req) for k in types.linear if kept_format(k, req)]
    others = [k for k in types.linear if not kept_format(k, req)]
    if others:
        ours.append(f"{'/'.join(others)} " + (f"requantized to {requantize}" if requantize else "dequantized to fp32"))
    embedding = kept_format(types.embedding) or "fp32"
    head = "embedding/head" if types.head is None else \
        f"embedding, {kept_format(types.head) or 'fp32'} head"
    return f"GGUF import: {' + '.join(ours)} + {embedding} {head}"


def bench_e2e_gguf(path, *, tokenizer=None, requantize: Optional[str] = None, prompt_tokens: int = 256,
                   new_tokens: int = 64, threads: int = 2, repeats: int = 3, modes=MODES, peers: bool = True,
                   profile: bool = False, progress: Optional[Callable[[str], None]] = None
                   ) -> tuple[list[list[str]], dict]:
    """Rows (E2E_HEADERS but the fp32 column) of llama.cpp on the GGUF file at path and of from_gguf's
    import of it (its blocks as stored, or requantize= as from_gguf takes it), and a dict of run facts.
    tokenizer: makes the prompt ids (default: the file's own)."""
    from ..io import from_gguf
    from ..io.gguf import gguf_tokenizer, open_gguf
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    path = Path(path)
    types = check_bench_gguf(path)
    label = import_plan(types, requantize)
    ids = prompt_ids(tokenizer or gguf_tokenizer(open_gguf(path), path), prompt_tokens)
    facts = {"threads": threads, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats,
             "llama.cpp": llama_cpp_fact(peers), "types": types}
    peer = peer_of(path) if peers and llama_cpp_available() else None
    imported = lambda: (from_gguf(path, requantize=requantize, tokenizer=False)[0], label, None)  # noqa: E731
    results = time_section([imported], ids, peer, new_tokens=new_tokens, threads=threads, repeats=repeats,
                           modes=modes, progress=progress, facts=facts, profile=profile)
    return format_rows(results, vs_fp32=False), facts


def perplexity_rows(path, *, tokens: int = PPL_TOKENS, ctx: int = PPL_CTX, threads: int = 2,
                    peers: bool = True) -> list[list[str]]:
    """PPL_HEADERS rows: our import of the GGUF file at path (its blocks as stored) and llama.cpp on the file, both over the first `tokens` tokens of the Wikipedia text (the file's tokenizer) in
    windows of ctx, every next token scored (eval.perplexity's protocol for both)."""
    import torch

    from ..eval.assets import wiki_text
    from ..eval.perplexity import perplexity
    from ..io import from_gguf
    from ..io.gguf import gguf_tokenizer, open_gguf
    from .e2e import llama_cpp_perplexity
    path = Path(path)
    label = import_plan(check_bench_gguf(path))
    tokenizer = gguf_tokenizer(open_gguf(path), path)
    text = wiki_text(400)
    model = from_gguf(path, tokenizer=False)[0]
    ours = perplexity(model, tokenizer, text, ctx=ctx, max_tokens=tokens, progress=False)
    del model
    rows = []
    if peers and llama_cpp_available():
        ids = tokenizer(text, return_tensors="pt").input_ids[0][:tokens]
        theirs = llama_cpp_perplexity(path, ids, ctx, threads)
        rows.append(["llama.cpp (the file)", f"{theirs:.4f}", "1.0000x"])
        rows.append([label, f"{ours:.4f}", f"{ours / theirs:.4f}x"])
    else:
        rows.append([label, f"{ours:.4f}", "-"])
    torch.set_num_threads(threads)
    return rows


def e2e_sections(models: Sequence[str] = ("smollm2",), gguf_paths: Sequence = (), variants=E2E_VARIANTS,
                 ppl: bool = False, requantize: Optional[str] = None, **timing) -> Iterator[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of each table, as each is timed: SmolLM2 (its variants and llama.cpp on
    its bundled GGUF), the Llama-3.2-1B-shaped files (Q4_0 and Q2_K linear blocks; written once, then
    cached), then each GGUF path (ppl: and its perplexity next to llama.cpp's, perplexity_rows); requantize:
    from_gguf's argument for the timed imports of the GGUF files (the 1B ones and the paths).
    timing: bench_e2e's keyword arguments (prompt_tokens, new_tokens,
    threads, repeats, modes, peers, profile, progress)."""
    from ..eval.assets import load_smollm2
    from .gguf_recipe import LLAMA_1B_RECIPES, bench_gguf
    unknown = [m for m in models if m not in E2E_MODELS]
    if unknown:
        raise ValueError(f"bench e2e: unknown model {unknown[0]!r}; choose from {', '.join(E2E_MODELS)}")
    for path in gguf_paths:  # every file checked before anything is timed
        check_bench_gguf(path)
    if "smollm2" in models:
        rows, _ = bench_e2e(variants, **timing)
        yield "SmolLM2-135M-Instruct", E2E_HEADERS, rows
    if "llama-1b" in models:
        tokenizer = load_smollm2()[1]  # the files carry SmolLM2's tokenizer
        for recipe in LLAMA_1B_RECIPES:
            path = bench_gguf(recipe, timing.get("progress"))
            rows, facts = bench_e2e_gguf(path, tokenizer=tokenizer, requantize=requantize, **timing)
            yield (f"Llama-3.2-1B-shaped, {RANDOM_WEIGHTS}; GGUF {facts['types'].describe()} ({path})",
                   GGUF_E2E_HEADERS, rows)
    for path in gguf_paths:
        rows, facts = bench_e2e_gguf(path, requantize=requantize, **timing)
        yield f"{path}: GGUF {facts['types'].describe()}", GGUF_E2E_HEADERS, rows
        if ppl:
            yield (f"{path}: perplexity, first {PPL_TOKENS} Wikipedia tokens, windows of {PPL_CTX} (the same "
                   "tokens and windows for both)", PPL_HEADERS,
                   perplexity_rows(path, threads=timing.get("threads", 2), peers=timing.get("peers", True)))
