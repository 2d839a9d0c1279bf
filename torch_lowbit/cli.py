"""Command line: python -m torch_lowbit {demo,generate,quantize,eval,bench,formats,gcb-learn,lm-eval,lm-eval-tasks}."""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

from .bench.cli import add_bench_parser, bench_format_names
from .bench.table import markdown_table
from .core.packing import GCB_CODE_BITS


class CliError(Exception):
    """A problem to report as one line (exit code 2), not a traceback."""


def _load_model(spec: str, dtype: str = "float32"):
    import torch
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise CliError(f"loading a model needs the eval extra ({e.name} is missing): "
                       "pip install 'torch_lowbit[eval]'") from None

    from .eval.assets import load_smollm2
    if spec == "smollm2":
        return load_smollm2(dtype)
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=getattr(torch, dtype))
    return model.eval(), AutoTokenizer.from_pretrained(spec)


def _load_checkpoint(path: str, spec: str):
    """A save_quantized file of the model `spec`, or a torch_lowbit HF folder: no float detour."""
    from transformers import AutoTokenizer

    from .eval.assets import smollm2_dir
    from .hf import load_quantized_model
    base = str(smollm2_dir()) if spec == "smollm2" else spec
    model, tok = load_quantized_model(path, base_model=base)
    return model, tok or AutoTokenizer.from_pretrained(base)


def _quantize(model, tok, args):
    from . import quantize_
    from .eval.assets import calibration_batches
    from .nn import MSQ, MixedBits, mix_summary
    calib = calibration_batches(tok, args.calib, args.ctx) if args.rounding != "rtn" else None
    msq = getattr(args, "msq", False)
    if msq:
        fmt = MSQ(args.mix or "palette", args.target_bpw, target_latency_ms=getattr(args, "target_latency_ms", None),
                  target_tokens_per_s=getattr(args, "target_tokens_per_s", None), loss=args.sensitivity or "linearity")
    else:
        fmt = MixedBits(args.mix, args.target_bpw, args.sensitivity) if args.mix else args.format
    quarot = getattr(args, "quarot", None)  # (callers building their own Namespace may leave it out)
    if quarot:
        import dataclasses

        from .quarot import QuaRot
        fmt = QuaRot.parse(quarot, rounding=args.rounding,  # the spec was checked before any work
                           rotate=not getattr(args, "no_rotation", False), smooth=getattr(args, "smooth", None),
                           act_block=getattr(args, "act_block", None) or 0,
                           sequential=getattr(args, "sequential", False),
                           **({"kv_group": args.kv_group} if getattr(args, "kv_group", None) else {}))
        if fmt.weights is not None:
            fmt = dataclasses.replace(fmt, weights=args.format)
        if calib is None and (fmt.acts is not None or fmt.smooth is not None):
            # the clip-ratio search and the smoothing scales need a few windows even with rtn
            from .quarot import SMOOTH_WINDOWS
            calib = calibration_batches(tok, min(args.calib, SMOOTH_WINDOWS if fmt.smooth is not None else 2), args.ctx)
    how = f"{args.rounding}, {len(calib)} calibration windows of {args.ctx} tokens" if calib else "rtn, data-free"
    what = f"QuaRot {fmt.label()}" if quarot else _format_label(args)
    print(f"quantizing to {what} ({how}); with calibration this takes minutes on a 2-core CPU...", flush=True)
    quantize_(model, fmt, calibration=calib, rounding=None if quarot else args.rounding,
              skip_incompatible=args.skip_incompatible, include_lm_head=args.include_lm_head,
              **({} if quarot else {"sequential": getattr(args, "sequential", False)}))
    if args.mix or msq:
        if msq:
            how = "MSQ, " + ("data-free linearity-theorem sensitivities" if (args.sensitivity or "linearity") ==
                             "linearity" else "Fisher-weighted errors") + ", exact solver"
        else:
            how = "sensitivity: " + ((args.sensitivity or "fisher") if calib else "data-free weight error")
        print(f"per-layer formats ({' / '.join(args.mix) if args.mix else 'the Q-Palette formats'}, target "
              f"{_budget_label(args, ' and ', 'bits per weight')}, {how}):")
        print(mix_summary(model), flush=True)
    return model


def _kv_cache_factory(model, ctx: int):
    """Fresh quantized KV caches for perplexity windows when the model records a KV setting (QuaRot kv=)."""
    from .quarot import kv_cache_config, kv_cache_for
    return (lambda: kv_cache_for(model, ctx)) if kv_cache_config(model) else None


def _vq_kv_cache_factory(model, tok, args):
    """Fresh CQ caches (VQKVCache) for perplexity windows, their codebooks learned on --calib windows."""
    from .eval.assets import calibration_batches
    from .kv_cache import VQKVCache, learn_kv_codebooks_on
    n = min(args.calib or 8, 8)
    print(f"learning {args.kv_vq} KV codebooks on {n} calibration windows of {args.ctx} tokens...", flush=True)
    books = learn_kv_codebooks_on(model, calibration_batches(tok, n=n, ctx=args.ctx), args.kv_vq)
    return lambda: VQKVCache(model.config, args.ctx, books)


def _format_label(args) -> str:
    if getattr(args, "msq", False):
        return f"MSQ over {'+'.join(args.mix) if args.mix else 'the palette'} @ {_budget_label(args, ' + ', 'bpw')}"
    return f"mix {'+'.join(args.mix)} @ {args.target_bpw} bpw" if args.mix else args.format


def _budget_label(args, joiner: str, bits_unit: str) -> str:
    """The --target-* budgets given, e.g. "3.0 bpw + 8.0 ms"."""
    return joiner.join(b for b in (f"{args.target_bpw} {bits_unit}" if args.target_bpw else "",
                                   f"{args.target_latency_ms} ms" if getattr(args, "target_latency_ms", None) else "",
                                   f"{args.target_tokens_per_s} tokens/s" if getattr(args, "target_tokens_per_s", None)
                                   else "") if b)


def _median(values) -> float:
    import statistics
    return statistics.median(values)


def _kernel_line(threads: int) -> str:
    """Which CPU ISA path and how many threads ran: numbers from other paths are not comparable."""
    from .ops.extension import has_cpu_extension
    if not has_cpu_extension():
        return f"CPU kernels: none (build-free install: torch references), {threads} threads"
    from .bench.machine import machine_line
    return f"{machine_line()}; {threads} threads"


def cmd_demo(args) -> None:
    """The main job: SmolLM2 in fp32 as transformers runs it (eager, model.generate) next to the
    quantized model (q8_0 embedding/head) on the fast route (torch_lowbit.generate), and llama.cpp
    on the bundled GGUF when llama-cpp-python is installed: size, perplexity, prefill and decode tok/s."""
    import torch

    from .bench.e2e import llama_cpp_available, llama_cpp_fact, peer_of, time_llama_cpp
    from .eval import perplexity, wiki_text
    from .eval.assets import smollm2_gguf
    from .eval.speed import model_nbytes, prompt_ids
    from .generate_route import fast_route, generate, timed_transformers_generate
    from .nn import quantize_embeddings_
    print("loading SmolLM2-135M-Instruct (converted once from the bundled GGUF, then cached)...", flush=True)
    model, tok = _load_model("smollm2")
    threads = torch.get_num_threads()
    print(_kernel_line(threads), flush=True)
    text, ids, n = wiki_text(400), prompt_ids(tok, args.prompt_tokens), args.gen
    rows = []

    def add_row(label, route, mb, ppl, runs):
        prefill, decode = _median([t.prefill_tokens_per_s for t in runs]), _median([t.decode_tokens_per_s for t in runs])
        rows.append([label, route, f"{mb:.1f}", ppl, f"{prefill:.1f}", f"{decode:.1f}"])
        print(f"  {label} ({route}): perplexity {ppl}, prefill {prefill:.1f} tok/s, decode {decode:.1f} tok/s",
              flush=True)
        return decode

    def timed(run):
        run()  # warm-up (on the fast route: the compile)
        return [run()[1] for _ in range(args.repeats)]

    def ppl_of(m):
        return f"{perplexity(m, tok, text, ctx=args.ctx, max_tokens=args.tokens, kv_cache=_kv_cache_factory(m, args.ctx)):.3f}"

    print("fp32, as transformers runs it (eager model.generate)...", flush=True)
    base_ppl = ppl_of(model)
    base_decode = add_row("fp32", "transformers eager", model_nbytes(model)["total"] / 1e6, base_ppl, timed(
        lambda: timed_transformers_generate(model, ids, n, min_new_tokens=n, do_sample=False)))
    qmodel = copy.deepcopy(model)
    t0 = time.time()
    _quantize(qmodel, tok, args)
    if args.embedding != "none":
        quantize_embeddings_(qmodel, args.embedding)
    qt = time.time() - t0
    label = f"{_format_label(args)} ({args.rounding}{f', {args.calib} calib windows' if args.rounding != 'rtn' else ''}" \
            f"{', lm_head too' if args.include_lm_head else ''})" + \
            (f" + {args.embedding} embedding/head" if args.embedding != "none" else "")
    compile = not args.no_compile
    q_ppl = ppl_of(qmodel)
    if compile:
        print("generating on the fast route: the native decoder where it runs the model (at once), else compiled "
              "steps (the first call compiles, about 2 minutes on 2 cores)...", flush=True)
    # eos_token_id=None: every run decodes all n tokens, as the fp32 row's min_new_tokens makes it
    q_times = timed(lambda: generate(qmodel, ids, n, compile=compile, eos_token_id=None, return_times=True))
    route = {"native": "torch_lowbit.generate, native decoder", "compiled": "torch_lowbit.generate, compiled",
             "eager": "torch_lowbit.generate, eager loop"}.get(fast_route(qmodel), "model.generate (fallback)")
    q_decode = add_row(label, route, model_nbytes(qmodel)["total"] / 1e6, q_ppl, q_times)
    sample = generate(qmodel, tok("The three laws of thermodynamics", return_tensors="pt").input_ids, 24,
                      compile=compile)
    peer = None
    if llama_cpp_available():
        print("llama.cpp on the bundled GGUF file, same prompt ids and threads...", flush=True)
        prefill, decode = time_llama_cpp(smollm2_gguf(), ids[0].tolist(), n, threads, args.repeats)
        peer = [peer_of(smollm2_gguf()).label, "llama.cpp", f"{smollm2_gguf().stat().st_size / 1e6:.1f}", "-",
                f"{_median(prefill):.1f}", f"{_median(decode):.1f}"]
        rows.insert(0, peer)
    print()
    print(f"SmolLM2-135M-Instruct; perplexity: first {args.tokens} Wikipedia tokens, ctx {args.ctx}; speed: a "
          f"{args.prompt_tokens}-token prompt, {n} greedy new tokens, batch 1, median of {args.repeats} runs; "
          f"quantization took {qt:.0f}s")
    print(_kernel_line(threads))
    print(markdown_table(["model", "route", "size MB", "perplexity", "prefill tok/s", "decode tok/s"], rows))
    print(f"perplexity change: {100 * (float(q_ppl) / float(base_ppl) - 1):+.1f}%; decode {q_decode / base_decode:.2f}x "
          f"fp32's" + (f", {q_decode / float(peer[5]):.2f}x llama.cpp's" if peer else ""))
    if peer is None:
        print(f"llama.cpp: {llama_cpp_fact(True)}")
    print(f"sample ({label}): {tok.decode(sample[0], skip_special_tokens=True)!r}")


def _load_for_generation(args):
    """(model, tokenizer) of the generate command's MODEL: a .gguf file, a save_quantized .safetensors
    file (of --base), 'smollm2' or a Hugging Face folder (a torch_lowbit one too); --format quantizes it."""
    from .io import from_gguf
    from .nn import QuantLinear, quantize_, quantize_embeddings_
    spec = args.model
    if spec.endswith(".gguf"):
        model, tok = from_gguf(spec)
    elif spec.endswith(".safetensors"):
        model, tok = _load_checkpoint(spec, args.base)
    else:
        model, tok = _load_model(spec)
    if tok is None:
        raise CliError(f"{spec}: no tokenizer found with the model; generate needs one")
    if args.format:
        if any(isinstance(m, QuantLinear) for m in model.modules()):
            raise CliError(f"--format {args.format}: {spec} is already quantized; --format quantizes a float model")
        fmt, _, embedding = args.format.partition("+")
        print(f"quantizing to {fmt} (rtn){f' + {embedding} embedding/head' if embedding else ''}...", file=sys.stderr,
              flush=True)
        quantize_(model, fmt, progress=False)
        if embedding:
            quantize_embeddings_(model, embedding)
    return model.eval(), tok


def _prompt_ids(tok, prompt: str, raw: bool):
    """The prompt's ids: as a user turn of the tokenizer's chat template (with the assistant's turn
    opened) when it has one, else (or with --raw) the text as it is."""
    if not raw and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        return tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tok(prompt, return_tensors="pt").input_ids


def cmd_generate(args) -> None:
    """Streams the model's continuation of --prompt to stdout (torch_lowbit.generate: the fast route
    or, saying why, model.generate); prefill and decode tok/s to stderr."""
    from transformers import TextStreamer

    from .generate_route import fast_route, generate
    print(f"loading {args.model}...", file=sys.stderr, flush=True)
    model, tok = _load_for_generation(args)
    ids = _prompt_ids(tok, args.prompt, args.raw)
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p))
                if v is not None}
    options = dict(do_sample=True, **sampling) if sampling else dict(do_sample=False)
    if model.generation_config.eos_token_id is None and tok.eos_token_id is not None:
        options["eos_token_id"] = tok.eos_token_id
    if not args.no_compile:
        print("the fast route: the native decoder where it runs the model, else compiled steps (their first call "
              "compiles: a minute or more on a small CPU)...", file=sys.stderr, flush=True)
    out, times = generate(model, ids, args.max_new_tokens, compile=not args.no_compile, seed=args.seed,
                          streamer=TextStreamer(tok, skip_prompt=not args.raw, skip_special_tokens=True),
                          return_times=True, **options)
    print(f"prefill {times.prefill_tokens_per_s:.1f} tok/s ({times.prompt_tokens} prompt tokens), decode "
          f"{times.decode_tokens_per_s:.1f} tok/s ({out.shape[1] - ids.shape[1]} new tokens); "
          f"{fast_route(model) or 'model.generate'}", file=sys.stderr)


def cmd_quantize(args) -> None:
    if not args.out.endswith((".safetensors", ".gguf")):  # a folder: stream the model block by block into it
        return _quantize_streaming(args)
    from . import save_quantized
    model, tok = _load_model(args.model)
    _quantize(model, tok, args)
    if args.out.endswith(".gguf"):  # a llama.cpp file (to_gguf): SmolLM2's tokenizer from its bundled GGUF
        from .eval.assets import smollm2_gguf
        from .io import to_gguf
        to_gguf(model, args.out, template=smollm2_gguf() if args.model == "smollm2" else None)
    else:
        save_quantized(model, args.out)
    print(f"saved {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB)")


def _quantize_streaming(args) -> None:
    """quantize --out DIR: one decoder block in memory at a time (models larger than memory), written
    as a Hugging Face folder that from_pretrained loads after `import torch_lowbit`."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise CliError(f"quantizing into a folder needs the hf extra ({e.name} is missing): "
                       "pip install 'torch_lowbit[hf]'") from None
    from .eval.assets import calibration_batches, smollm2_dir
    from .hf import quantize_streaming
    if args.quarot:
        raise CliError("--quarot rotates the whole model; quantize to a .safetensors file instead")
    if args.mix or getattr(args, "msq", False):
        raise CliError("--mix / --msq allocate over the whole model; quantize to a .safetensors file instead, or "
                       "allocate a plan with torch_lowbit.allocate_formats and pass it to quantize_streaming")
    src = str(smollm2_dir()) if args.model == "smollm2" else args.model
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise CliError(f"--model {args.model}: quantizing into a folder streams a Hugging Face model folder "
                       "(config.json + safetensors shards); pass one, or --out FILE.safetensors")
    calib = calibration_batches(AutoTokenizer.from_pretrained(src), args.calib, args.ctx) \
        if args.rounding != "rtn" else None
    print(f"quantizing {src} block by block to {args.format} ({args.rounding}) into {args.out}...", flush=True)
    quantize_streaming(src, args.format, args.out, rounding=args.rounding, calibration=calib,
                       include_lm_head=args.include_lm_head)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"saved {args.out}/ ({size / 1e6:.1f} MB): AutoModelForCausalLM.from_pretrained after import torch_lowbit")


def cmd_eval(args) -> None:
    if args.lm_eval:
        from .eval.lm_eval_model import run_lm_eval
        margs = f"pretrained={args.model}" + (f",checkpoint={args.checkpoint}" if args.checkpoint else
                                              f",format={args.format}")
        res = run_lm_eval(margs, n_docs=args.docs, limit=args.limit)
        print(markdown_table(["metric", "value"], [[k, f"{v:.4f}" if isinstance(v, float) else v] for k, v in res.items()]))
        return
    from .eval import perplexity, wiki_text
    if args.checkpoint:
        model, tok = _load_checkpoint(args.checkpoint, args.model)
    else:
        model, tok = _load_model(args.model)
        if args.mix or args.quarot or args.format != "none":
            _quantize(model, tok, args)
    from . import use_backend
    from .quarot import kv_cache_config
    kv = _kv_cache_factory(model, args.ctx)
    kv_note = f", KV cache {kv_cache_config(model)['bits']}-bit" if kv else ""
    if getattr(args, "kv_vq", None):
        kv, kv_note = _vq_kv_cache_factory(model, tok, args), f", KV cache {args.kv_vq}"
    with use_backend(args.backend):
        ppl = perplexity(model, tok, wiki_text(400), ctx=args.ctx, max_tokens=args.tokens, kv_cache=kv)
    print(f"perplexity ({args.tokens} tokens, ctx {args.ctx}, backend {args.backend}{kv_note}): {ppl:.3f}")


def cmd_formats(args) -> None:
    from . import formats, get_format
    if args.explain:
        from .tools.format_index import explain
        print(explain(args.explain))
        return
    print(markdown_table(["format", "group", "bits/weight"],
                 [[f, get_format(f).group_size, f"{get_format(f).bits_per_weight():.3f}"] for f in formats()]))


def cmd_gcb_learn(args) -> None:
    """Learns gcb codebooks from a model's linear layers and writes them (keys b2, b3) for
    GroupCodebook(bits, codebooks=FILE)."""
    import torch
    from safetensors.torch import save_file

    from .tools.gcb_learn import learn_codebooks
    if args.model == "smollm2":
        model, _ = _load_model("smollm2")
    else:  # any architecture (encoders too): only its nn.Linear weights are read
        from transformers import AutoModel
        model = AutoModel.from_pretrained(args.model).eval()
    weights = [m.weight for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
    if not weights:
        raise SystemExit(f"gcb-learn: {args.model} has no nn.Linear layers to learn from")
    tables = {f"b{b}": learn_codebooks(weights, b, args.count, seed=args.seed) for b in args.bits}
    save_file(tables, args.out, metadata={"source": args.model, "count": str(args.count)})
    for key, t in tables.items():
        print(f"{key}: {t.shape[0]} codebooks of {t.shape[1]} int8 entries")
    print(f"wrote {args.out}; use it as GroupCodebook(bits, codebooks={args.out!r})")


def cmd_lm_eval(lm_eval_argv) -> None:
    try:
        from .eval.lm_eval_model import run_lm_eval_cli
    except ImportError as e:
        print(f"python -m torch_lowbit lm-eval: error: needs the eval extra ({e.name} is missing): "
              "pip install 'torch_lowbit[eval]'", file=sys.stderr)
        raise SystemExit(2) from None
    run_lm_eval_cli(lm_eval_argv)


def cmd_lm_eval_tasks(args) -> None:
    from .eval.lm_eval_model import tasks_dir
    print(tasks_dir(args.docs))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m torch_lowbit", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def quant_opts(sp, default_rounding="rtn"):
        sp.add_argument("--format", default="q4_0", help="format name (see `formats`)")
        sp.add_argument("--rounding", default=default_rounding, choices=["rtn", "imatrix", "gptq", "mixed"])
        sp.add_argument("--calib", type=int, default=32, help="calibration windows (of --ctx tokens)")
        sp.add_argument("--sequential", action="store_true", help="calibrate layer by layer on the outputs of the "
                        "already quantized layers (GPTQ's protocol) instead of the float model's, in one pass")
        sp.add_argument("--skip-incompatible", action="store_true",
                        help="keep layers the group size does not divide in float")
        sp.add_argument("--ctx", type=int, default=512)
        sp.add_argument("--include-lm-head", action="store_true", help="quantize the LM head too")
        sp.add_argument("--mix", nargs="+", metavar="FMT", help="instead of --format: a per-layer mix of these "
                        "formats (e.g. gcb2_sb192 gcb3_sb192), each layer's picked by measured sensitivity "
                        "within --target-bpw (from the calibration unless --rounding rtn)")
        sp.add_argument("--msq", action="store_true", help="instead of --format: mixed-scheme quantization (Q-Palette "
                        "MSQ): each layer's format from the Q-Palette formats (or the --mix list) for the least "
                        "predicted loss within --target-bpw, solved exactly; data-free sensitivities by default")
        sp.add_argument("--quarot", metavar="SPEC", help="QuaRot recipe, e.g. W4A4KV4, W4A8KV8, W16A4: rotate the "
                        "model, then weights in --format (--rounding, gptq recommended), per-token activations "
                        "and the KV cache to those bits (16 = float)")
        sp.add_argument("--no-rotation", action="store_true", help="with --quarot: the same rounding without the "
                        "rotation (QuaRot's baseline column)")
        sp.add_argument("--smooth", type=float, metavar="ALPHA", help="with --quarot: smooth each down_proj input "
                        "by max|x|^ALPHA on the calibration before rotating (0.25 measured best)")
        sp.add_argument("--act-block", type=int, metavar="N", help="with --quarot: one activation scale per N "
                        "features of a token (32, MXINT4-style; 16 or 8: two-level scales inside blocks of 32, at most 4 bits) "
                        "instead of per token; rounded in the CPU kernels")
        sp.add_argument("--kv-group", type=int, metavar="N", help="with --quarot ...KV4/KV8: features per KV-cache "
                        "scale (default 64; 32 measured better at KV4)")
        sp.add_argument("--target-bpw", type=float, help="with --mix / --msq: the bit budget, bits per weight over "
                        "the quantized layers")
        sp.add_argument("--target-latency-ms", type=float, help="with --msq: the latency budget, the quantized "
                        "modules' summed forward time at batch 1 as `bench latency` measures it on this machine "
                        "(measured and cached on first use)")
        sp.add_argument("--target-tokens-per-s", type=float, help="with --msq: the latency budget as a rate, "
                        "1000 / --target-latency-ms (the quantized layers' own rate at batch 1)")
        sp.add_argument("--sensitivity", choices=["fisher", "output", "linearity"], help="with --mix: fisher "
                        "(default with calibration): errors weighted by the loss's squared gradients; output: by "
                        "the layer inputs' E[x²] (no backward pass). With --msq: linearity (default, data-free) "
                        "or fisher (needs calibration: --rounding other than rtn)")

    sp = sub.add_parser("demo", help="main job: SmolLM2 in fp32 (transformers, eager) next to quantized (q8_0 "
                        "embedding/head, torch_lowbit.generate's compiled route) and llama.cpp when installed: "
                        "size, perplexity, prefill and decode tokens/s")
    quant_opts(sp, "mixed")
    sp.add_argument("--embedding", default="q8_0", help="format of the embedding and tied LM head, or 'none' (float)")
    sp.add_argument("--tokens", type=int, default=4096, help="perplexity tokens")
    sp.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for the prefill speed")
    sp.add_argument("--gen", type=int, default=64, help="new tokens for the decode speed")
    sp.add_argument("--repeats", type=int, default=3, help="timed runs per row (median), after a warm-up")
    sp.add_argument("--no-compile", action="store_true", help="the fast route's loop eagerly (no compile)")
    sp.set_defaults(fn=cmd_demo)

    sp = sub.add_parser("generate", help="stream a model's continuation of a prompt (torch_lowbit.generate: "
                        "static KV cache + compiled steps, or model.generate, saying why)",
                        description="Streams the generated text to stdout as it comes; prefill and decode tok/s "
                        "to stderr. Greedy unless a sampling option is given.")
    sp.add_argument("model", metavar="MODEL", help="'smollm2', a Hugging Face folder (a torch_lowbit one too), a "
                    "llama.cpp .gguf file, or a save_quantized .safetensors file of --base")
    sp.add_argument("--prompt", required=True, help="the user's message (in the chat template when the tokenizer "
                    "has one), or with --raw the text to continue")
    sp.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text as it is")
    sp.add_argument("--format", help="quantize a float MODEL first (rtn): FORMAT, or FORMAT+EMB for the "
                    "embedding and tied head too, e.g. q4_0+q8_0")
    sp.add_argument("--base", default="smollm2", help="with a .safetensors MODEL: the model it was quantized from")
    sp.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many new tokens (or at eos)")
    sp.add_argument("--temperature", type=float, help="sample at this temperature (> 0)")
    sp.add_argument("--top-k", type=int, help="sample from the K most likely tokens (0: all; default 50 when sampling)")
    sp.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with probability >= P (0 < P <= 1)")
    sp.add_argument("--seed", type=int, help="with a sampling option: reproducible draws")
    sp.add_argument("--no-compile", action="store_true", help="run the loop eagerly (no compile: starts at once, "
                    "decodes slower)")
    sp.set_defaults(fn=cmd_generate)

    sp = sub.add_parser("quantize", help="quantize a model and save it: --out FILE.safetensors (save_quantized, "
                        "whole model in memory) or --out DIR (a Hugging Face folder, streamed one decoder block "
                        "at a time: models larger than memory)")
    sp.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face model directory")
    quant_opts(sp)
    sp.add_argument("--out", required=True, help="FILE.safetensors (save_quantized), FILE.gguf (to_gguf: a llama.cpp "
                    "file; formats with GGUF blocks: q4_0, q8_0, iq4_nl, int4_g32, q5_0, q5_1, q2_k .. q6_k and "
                    "llama.cpp's mixes q4_k_m, q2_k, ...) or DIR (a Hugging Face folder, streamed)")
    sp.set_defaults(fn=cmd_quantize)

    sp = sub.add_parser("eval", help="perplexity (or lm-eval) of a quantized model")
    sp.add_argument("--model", default="smollm2")
    quant_opts(sp)
    sp.add_argument("--checkpoint", help="a save_quantized file of --model, or a torch_lowbit HF folder, instead of --format")
    sp.add_argument("--backend", default="auto", choices=["auto", "reference"],
                    help="reference: fp32 activations times the dequantized weight (weights-only quality, any format)")
    sp.add_argument("--tokens", type=int, default=4096)
    sp.add_argument("--kv-vq", choices=["cq2", "cq4"], help="score through a vector-quantized KV cache (CQ: one "
                    "k-means codebook per channel group and layer, learned on min(--calib, 8) calibration windows)")
    sp.add_argument("--lm-eval", action="store_true", help="run the lm-eval `lowbit` model on the local task")
    sp.add_argument("--docs", type=int, default=64, help="documents in the local lm-eval task")
    sp.add_argument("--limit", type=int, default=None)
    sp.set_defaults(fn=cmd_eval)

    add_bench_parser(sub, _cpu_paths)

    sp = sub.add_parser("gcb-learn", help="learn group-codebook (gcb) tables from a model's linear layers")
    sp.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face model directory")
    sp.add_argument("--bits", type=int, nargs="+", default=list(GCB_CODE_BITS), choices=GCB_CODE_BITS)
    sp.add_argument("--count", type=int, default=16, choices=[4, 8, 16], help="codebooks per bit width")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--out", required=True, help="output .safetensors file")
    sp.set_defaults(fn=cmd_gcb_learn)

    sp = sub.add_parser("formats", help="list formats, or explain one")
    sp.add_argument("--explain", metavar="FORMAT", help="where one format's math, layouts, ops, kernels and tests are")
    sp.set_defaults(fn=cmd_formats)

    sub.add_parser("lm-eval", help="lm-eval's own command line with the `lowbit` model, the torch_lowbit HF "
                   "quantizer and the local `lowbit_wiki` task registered: python -m torch_lowbit lm-eval "
                   "--model lowbit --model_args pretrained=smollm2,format=q4_0 --tasks lowbit_wiki (any lm_eval "
                   "arguments)", add_help=False)

    sp = sub.add_parser("lm-eval-tasks", help="print the folder of the local lm-eval task (for --include_path)")
    sp.add_argument("--docs", type=int, default=64)
    sp.set_defaults(fn=cmd_lm_eval_tasks)

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # every argument is lm-eval's: hand them over unparsed
        return cmd_lm_eval(argv[1:])
    args = p.parse_args(argv)
    import logging
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("torch_lowbit").setLevel(logging.INFO)  # layers left in float, layouts chosen
    _check_before_work(p, args)
    msq = getattr(args, "msq", False)
    latency = getattr(args, "target_latency_ms", None), getattr(args, "target_tokens_per_s", None)
    if any(v is not None for v in latency) and not msq:
        p.error("--target-latency-ms and --target-tokens-per-s go with --msq")
    if all(v is not None for v in latency):
        p.error("give --target-latency-ms or --target-tokens-per-s, not both (one budget: ms = 1000 / tokens/s)")
    if (getattr(args, "mix", None) or msq) and args.target_bpw is None and all(v is None for v in latency):
        p.error(f"{'--msq needs --target-bpw and/or --target-latency-ms (or --target-tokens-per-s)' if msq else '--mix needs --target-bpw'} "
                "(bits per weight, e.g. 3.2)")
    if (getattr(args, "target_bpw", None) is not None or getattr(args, "sensitivity", None)) and not \
            (args.mix or msq):
        p.error("--target-bpw and --sensitivity go with --mix FMT FMT ... or --msq")
    if getattr(args, "sensitivity", None) == "linearity" and not msq:
        p.error("--sensitivity linearity is MSQ's loss model: add --msq")
    if msq and getattr(args, "sensitivity", None) == "output":
        p.error("--msq predicts the loss by linearity (default) or fisher; --sensitivity output is --mix's")
    if msq and getattr(args, "sensitivity", None) == "fisher" and args.rounding == "rtn":
        p.error("--msq --sensitivity fisher needs calibration: pass --rounding imatrix (or gptq)")
    if (getattr(args, "mix", None) or msq) and getattr(args, "lm_eval", False):
        p.error("--mix / --msq are not available with --lm-eval yet; quantize to a checkpoint and pass --checkpoint")
    from .io import CheckpointError
    try:
        args.fn(args)
    except (CliError, CheckpointError, ValueError, FileNotFoundError, ImportError) as e:
        # the library's own errors name the fix: one line, like argparse's errors (TORCH_LOWBIT_TRACEBACK=1: all)
        if os.environ.get("TORCH_LOWBIT_TRACEBACK"):
            raise
        print(f"{p.prog} {args.cmd}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _cpu_paths() -> list[str]:
    """The CPU kernel paths this machine can run, best first (none without the C++ extension: a
    build-free install runs the Triton kernels and the CPU references, no ISA path)."""
    from .ops.extension import cpu_extension, has_cpu_extension
    return list(cpu_extension().available_cpu_paths()) if has_cpu_extension() else []


def _check_generate_args(p: argparse.ArgumentParser, args) -> None:
    from .sampling import check_sampling
    for flag, name in (("--temperature", "temperature"), ("--top-k", "top_k"), ("--top-p", "top_p"), ("--seed", "seed")):
        try:
            check_sampling(**{name: getattr(args, name)})
        except ValueError as e:
            p.error(f"{flag} {getattr(args, name)}: {e}")
    if args.seed is not None and args.temperature is None and args.top_k is None and args.top_p is None:
        p.error("--seed goes with sampling: add --temperature, --top-k or --top-p (without them decoding is greedy)")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if args.model.endswith((".gguf", ".safetensors")) and not os.path.isfile(args.model):
        p.error(f"{args.model}: no such file")


def _check_before_work(p: argparse.ArgumentParser, args) -> None:
    """What can be checked before a model loads or a layer quantizes: format names, files, output folder."""
    from .formats import get_format
    names = list(args.mix or []) if getattr(args, "mix", None) else []
    if args.cmd == "generate":
        _check_generate_args(p, args)
        names += args.format.split("+") if args.format else []
    elif getattr(args, "format", None) not in (None, "none") and not names and not getattr(args, "checkpoint", None):
        names.append(args.format)
    if getattr(args, "embedding", "none") != "none":
        names.append(args.embedding)
    if args.cmd == "bench":
        names += bench_format_names(p, args, _cpu_paths)
    names += [args.explain] if getattr(args, "explain", None) else []
    if getattr(args, "quarot", None):
        from .quarot import QuaRot
        try:
            QuaRot.parse(args.quarot)
        except ValueError as e:
            p.error(str(e))
        if args.mix or getattr(args, "msq", False):
            p.error("--quarot and --mix / --msq cannot be combined; pick one")
    smooth = getattr(args, "smooth", None)
    if smooth is not None and (not getattr(args, "quarot", None) or not 0.0 < smooth <= 1.0):
        p.error(f"--smooth {smooth}: needs --quarot and a value in (0, 1], e.g. --smooth 0.25")
    kv_group = getattr(args, "kv_group", None)
    if kv_group is not None and not getattr(args, "quarot", None):
        p.error(f"--kv-group {kv_group}: needs --quarot with a KV setting, e.g. --quarot W4A4KV4 --kv-group 32")
    act_block = getattr(args, "act_block", None)
    if act_block is not None and (not getattr(args, "quarot", None) or act_block <= 0
                                  or (act_block not in (8, 16) and act_block % 32)):
        p.error(f"--act-block {act_block}: needs --quarot and 16, 8 or a multiple of 32 features, e.g. --act-block 16")
    if getattr(args, "sequential", False) and (args.rounding == "rtn" or args.mix or getattr(args, "msq", False)):
        p.error("--sequential calibrates layer by layer: it needs --rounding gptq, imatrix or mixed, and no --mix")
    from .nn.ggml_mixes import NAMED_MIXES
    for name in names:
        if name in NAMED_MIXES and args.cmd == "quantize" and name == args.format:
            continue  # llama.cpp's mixes by name (q4_k_m, ...): quantize_ takes them
        try:
            get_format(name)
        except ValueError as e:
            p.error(f"{e}; or one of llama.cpp's mixes {', '.join(NAMED_MIXES)}" if args.cmd == "quantize" else str(e))
    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint and not os.path.exists(checkpoint):
        p.error(f"--checkpoint {checkpoint}: no such file or folder")
    out = getattr(args, "out", None)
    if out:
        folder = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            p.error(f"--out {out}: the folder {folder} does not exist or is not writable; create it first")


if __name__ == "__main__":
    main()
