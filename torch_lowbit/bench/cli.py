"""`python -m torch_lowbit bench ...`: the argument parser, the checks made before any work and the
command itself (each WHAT's module does the measuring and formats its table)."""
from __future__ import annotations

import argparse
from typing import Callable

from .table import markdown_table

CPU_BENCH_SHAPES = ["4096x4096", "14336x4096", "4096x14336"]
CPU_BENCH_FORMATS = ["q4_0", "iq4_nl", "int4_g32", "int4_g128"]


def cmd_bench(args) -> None:
    """Runs `python -m torch_lowbit bench WHAT` with the parsed arguments."""
    if args.what == "cpu":
        import torch

        from .cpu import bench_cpu, format_table
        from .machine import active_path, machine_line
        from ..ops import cpu_model
        formats = args.formats or CPU_BENCH_FORMATS
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes or CPU_BENCH_SHAPES]
        shapes = shapes[:1] if args.quick else shapes
        ms = (1, 8) if args.quick else tuple(args.m)
        paths = args.path or [active_path()]
        machine = machine_line()
        rows, bw = bench_cpu(shapes=shapes, ms=ms, threads=tuple(args.threads), formats=tuple(formats),
                             layouts=tuple(args.layouts) if args.layouts else None, rotate_mib=args.rotate_mib,
                             paths=paths, rounds=args.repeats or 1)
        print(format_table(rows, bw, machine))
        if args.png:
            from .plots import roofline_png
            print(f"roofline: {roofline_png(rows, bw, args.png, max(args.threads))}")
        where = f"CPU {cpu_model()}, active ISA path {active_path()}"
        if args.decode:
            from .cpu import bench_decode
            print()
            print(f"SmolLM2-135M greedy decode, batch 1, {torch.get_num_threads()} threads; {where}:")
            print(markdown_table(["model", "path", "linear weights MB", "tok/s", "vs fp32"],
                         bench_decode(tuple(formats[:1]), paths=paths)))
        if args.prefill:
            from .cpu import bench_prefill
            n = args.prompt_tokens or 128
            repeats = args.repeats or 5
            print()
            print(f"SmolLM2-135M prefill, eager, one forward pass over a {n}-token Wikipedia prompt, median of "
                  f"{repeats}; {where}:")
            print(markdown_table(["threads", "model", "path", "linear weights MB", "prefill tok/s", "vs fp32"],
                         bench_prefill(tuple(formats), threads=tuple(args.threads), prompt_tokens=n,
                                       repeats=repeats, paths=paths)))
    elif args.what == "gvq":
        from .gvq import GVQ_BENCH_FORMATS, GVQ_HEADERS, bench_gvq
        from .machine import machine_line
        n, k = (int(v) for v in (args.shapes or ["4096x4096"])[0].split("x"))
        ms = tuple(args.m) if args.m != [1, 8, 64, 512] else (1,)
        rounds = args.repeats or 3
        print(machine_line())
        print(f"gvq kernels vs q4_0, weights streamed from DRAM, median of {rounds} interleaved rounds:")
        print(markdown_table(GVQ_HEADERS, bench_gvq((n, k), tuple(args.formats or GVQ_BENCH_FORMATS), ms=ms,
                                                    threads=tuple(args.threads), paths=args.path,
                                                    rotate_mib=args.rotate_mib, rounds=rounds)))
    elif args.what == "kv":
        from .kv import KV_HEADERS, bench_kv
        from .machine import machine_line
        print(machine_line())
        rows = args.query_rows
        what = "decode attention, batch 1, one query row per head" if rows == 1 else \
            f"prefill attention, batch 1, {rows} causal query rows per head"
        print(f"{what}, caches streamed from DRAM (one layer shown):")
        print(markdown_table(KV_HEADERS, bench_kv(tokens=args.prompt_tokens or 4096, threads=tuple(args.threads),
                                          query_rows=rows)))
    elif args.what == "gpu":
        from . import gpu
        gpu.require_cuda()
        import torch
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes] if args.shapes else gpu.GPU_BENCH_SHAPES
        shapes = shapes[:1] if args.quick else shapes
        ms = (1, 8) if args.quick else tuple(args.m)
        rows = gpu.bench_gpu(shapes=shapes, ms=ms, formats=tuple(args.formats or gpu.GPU_BENCH_FORMATS),
                             rotate_mib=args.rotate_mib)
        print(gpu.format_gpu_table(rows, torch.cuda.get_device_name()))
        print()
        if args.profile:  # where each contender's eager call spends its host time (first shape, M = 1)
            n, k = shapes[0]
            x = torch.randn(1, k, device="cuda").half()
            for name, (make, _, _) in gpu._contenders(n, k, tuple(args.formats or gpu.GPU_BENCH_FORMATS), 0,
                                                     "cuda").items():
                print(f"{name}, {n}x{k}, M = 1:")
                print(gpu.host_profile(lambda: make(0)(x), sync=torch.cuda.synchronize))
                print()
        fht = gpu.fast_hadamard_transform_fn()
        if fht is None:
            print("fast_hadamard_transform is not installed: ours alone (pip install fast-hadamard-transform)")
        print(gpu.format_hadamard_table(gpu.bench_hadamard(ms, fht=fht)))
        from .kv import KV_HEADERS, bench_kv
        for tokens in ((args.prompt_tokens or 4096,) if args.quick or args.prompt_tokens else (4096, 32768)):
            print(f"\ndecode attention, batch 1, one query row per head, {tokens} cached tokens, caches streamed "
                  "from HBM (one layer shown; the Triton kv_attention kernel vs SDPA on an fp16 cache; µs eager, "
                  "and replayed from a CUDA graph where the calls can be captured, the ratios from those):")
            print(markdown_table(KV_HEADERS, bench_kv(tokens=tokens, device="cuda")))
    elif args.what == "e2e" and args.device == "cuda":
        from . import gpu
        from .e2e_cuda import CUDA_E2E_HEADERS, CUDA_E2E_MODELS, CUDA_E2E_VARIANTS, bench_e2e_cuda
        from .machine import gpu_line
        gpu.require_cuda("bench e2e --device cuda")
        prompt_tokens, repeats = args.prompt_tokens or 512, args.repeats or 3
        rows = bench_e2e_cuda(tuple(args.formats or CUDA_E2E_VARIANTS), tuple(args.models or CUDA_E2E_MODELS),
                              prompt_tokens=prompt_tokens, new_tokens=args.new_tokens, repeats=repeats)
        print(gpu_line())
        print(f"batch 1, prompt {prompt_tokens} tokens, {args.new_tokens} new tokens greedy, CompiledGenerator "
              f"(decode replayed from a CUDA graph), fp16 activations, median of {repeats}")
        print(markdown_table(CUDA_E2E_HEADERS, rows))
    elif args.what == "e2e":
        import torch

        from .cpu import dram_read_gbs
        from .e2e import E2E_VARIANTS, MODES, llama_cpp_fact
        from .e2e_gguf import e2e_sections
        from .machine import machine_line
        threads = max(args.threads)
        prompt_tokens, repeats = args.prompt_tokens or 256, args.repeats or 3
        print(machine_line())
        torch.set_num_threads(threads)
        print(f"batch 1, {threads} threads, prompt {prompt_tokens} tokens, {args.new_tokens} new tokens greedy, median "
              f"of {repeats}; DRAM read {dram_read_gbs():.1f} GB/s with {threads} threads (the read bandwidth the "
              f"decode GB/s columns draw on); llama.cpp: {llama_cpp_fact(not args.no_peers)}", flush=True)
        sections = e2e_sections(e2e_models(args), args.gguf or (), tuple(args.formats or E2E_VARIANTS),
                                prompt_tokens=prompt_tokens, new_tokens=args.new_tokens, threads=threads,
                                repeats=repeats, peers=not args.no_peers, profile=args.profile,
                                modes=("eager",) if args.quick else MODES, ppl=args.ppl, requantize=args.requantize)
        for title, headers, rows in sections:
            print(f"\n{title}:")
            print(markdown_table(headers, rows), flush=True)
    elif args.what == "roofline":
        from .roofline import ROOFLINE_FORMATS, bench_roofline, format_roofline
        n, k = (int(v) for v in (args.shapes or ["4096x4096"])[0].split("x"))
        rows, machine = bench_roofline(tuple(args.formats or ROOFLINE_FORMATS), n=n, k=k,
                                       threads=max(args.threads), rotate_mib=args.rotate_mib)
        print(format_roofline(rows, machine, n, k))
    elif args.what == "weights":
        from .distortion import bench_weights
        names = args.formats or ["int2_g64", "int2_sym_g64", "gcb2", "int3_g64", "gcb3"]
        print(f"normalized weight MSE |W - Ŵ|² / |W|² over the {args.model} linear layers every listed format holds\n")
        print(markdown_table(["format", "bits/weight", "layers", "normalized MSE"], bench_weights(args.model, names)))
    elif args.what == "latency":
        from ..eval.assets import load_smollm2
        from ..nn.msq import candidate_set
        from .latency import bench_latency, latency_title
        from .machine import machine_line
        if args.model != "smollm2":
            raise ValueError("bench latency measures a decoder's module shapes: --model smollm2")
        model, _ = load_smollm2()
        names = args.formats or candidate_set("palette")
        ms = tuple(args.m) if args.m != [1, 8, 64, 512] else (1, 16)
        print(machine_line())
        print(latency_title(args.device))
        header, rows = bench_latency(model, names, ms, args.device)
        print(markdown_table(header, rows))
    elif args.what == "distortion":
        from .distortion import bench_distortion, distortion_png, format_distortion_table
        rows, cols = (int(v) for v in (args.shapes or ["4096x4096"])[0].split("x"))
        table = bench_distortion(args.formats, rows=rows, cols=cols)
        print(format_distortion_table(table, f"{rows}x{cols}"))
        if args.png:
            print(f"plot: {distortion_png(table, args.png)}")


def e2e_models(args) -> list[str]:
    """The models `bench e2e` times on the CPU: --models, else SmolLM2 unless --gguf names files."""
    return list(args.models or ([] if args.gguf else ["smollm2"]))


def add_bench_parser(sub, cpu_paths: Callable[[], list[str]]) -> None:
    """Adds the `bench` sub-command to the top-level parser's sub-parsers; cpu_paths() lists the CPU
    kernel paths this machine can run (for --path's help)."""
    sp = sub.add_parser("bench", help="benchmarks")
    sp.add_argument("what", choices=["cpu", "e2e", "roofline", "gpu", "distortion", "weights", "kv", "latency", "gvq"],
                    help="cpu: kernels vs PyTorch, DRAM-streamed; e2e: prefill and decode tok/s, eager and "
                    "compiled, next to llama.cpp on the same GGUF (with the [peers] extra), with the weight bytes a "
                    "decoded token reads and the GB/s they make (--models, --gguf); SmolLM2's --formats: fp32, bf16, "
                    "gguf (the GGUF file imported: llama.cpp's weights), F or F+E (E: embedding and tied head); roofline: M=1 compute vs memory ceilings of the "
                    "int8 CPU kernels (max --threads); gpu: Triton kernels vs fp16 F.linear, "
                    "HBM-streamed (needs CUDA); distortion: palette formats on a Gaussian; weights: formats on a "
                    "real model's linear weights (--model); latency: each format's forward at SmolLM2's module shapes, "
                    "M 1 and 16 (--formats, default the palette; --m), cached for MSQ(target_latency_ms=...); "
                    "gvq: the general VQ formats' CPU kernels next to q4_0 and the codebook-cache ablation (table "
                    "kernel with entries ordered by use / at random, direct, decode; --formats, default gvq4x8 "
                    "aqlm_2x8 gptvq2; first --shapes, default 4096x4096; --m default 1; --repeats rounds, default 3); "
                    "kv: decode attention over a 4/8-bit KV cache vs fp32 "
                    "(--prompt-tokens cached tokens, --threads)")
    sp.add_argument("--quick", action="store_true", help="first shape only, M in {1, 8}; e2e: eager only")
    sp.add_argument("--model", default="smollm2", choices=["smollm2", "minilm"],
                    help="weights: whose linear layers (minilm: the all-MiniLM-L6-v2 encoder)")
    sp.add_argument("--shapes", nargs="+", help="weights as NxK (out x in); cpu default: "
                    f"{' '.join(CPU_BENCH_SHAPES)}; gpu default: 4096x4096 4096x14336; distortion default: "
                    "4096x4096 (first shape only)")
    sp.add_argument("--m", type=int, nargs="+", default=[1, 8, 64, 512])
    sp.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    sp.add_argument("--formats", nargs="+", help=f"cpu default: {' '.join(CPU_BENCH_FORMATS)} (F+a8 / F+a4: with per-token int8 / int4 activations, QuaRot; F+a4b16: one scale per 16 features); e2e (SmolLM2's rows): fp32 bf16 gguf F F+E, "
                    "each with @kv4 / @kv8 to generate on a quantized KV cache; gpu default: "
                    "q4_0 int4_g128 iq4_nl nuq3 vq2 tcq2 int2_g64 gcb2 (each in its CUDA layout; palette formats: rotation timed too); distortion default: every palette format")
    sp.add_argument("--layouts", nargs="+", help="CPU layouts to run where they hold the format (default: each "
                    "format's CPU default; lut*_i8_n16: int8 activations, lut4_rowmajor: fp32 activations)")
    sp.add_argument("--rotate-mib", type=int, default=512,
                    help="total size of the weight copies each contender cycles through (> L3 / the GPU's L2 "
                    "streams from DRAM / HBM)")
    sp.add_argument("--path", nargs="+", metavar="PATH",
                    help="cpu: the CPU ISA paths to time each torch_lowbit kernel on, side by side (this CPU: "
                    f"{' '.join(cpu_paths())}; default: the active one; PyTorch's contenders run once); "
                    "--decode / --prefill: the quantized models on each")
    sp.add_argument("--decode", action="store_true", help="cpu: also SmolLM2 decode tok/s: fp32, bf16, first format")
    sp.add_argument("--prefill", action="store_true", help="cpu: also SmolLM2 prefill tok/s of a 128-token prompt "
                    "(one eager forward pass) at each --threads: fp32 and each format, vs fp32")
    sp.add_argument("--prompt-tokens", type=int, help="e2e: prompt length (default 256); cpu --prefill: (default 128); "
                    "kv: cached tokens (default 4096)")
    sp.add_argument("--query-rows", type=int, default=1, help="kv: query rows per head (1: a decode step; more: "
                    "a causal prefill block at the end of the cache, against torch's SDPA)")
    sp.add_argument("--new-tokens", type=int, default=64, help="e2e: greedy new tokens (decode)")
    sp.add_argument("--repeats", type=int, help="e2e: timed runs per row, median (default 3); cpu --prefill: "
                    "forward passes per row, median (default 5); cpu kernels: rounds over all contenders, one "
                    "after the other, each row the median of its rounds (default 1)")
    sp.add_argument("--no-peers", action="store_true", help="e2e: leave llama.cpp out even if installed")
    sp.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="e2e: cuda: fp16 vs formats in their CUDA layouts on SmolLM2 and a Llama-3.2-1B-shaped "
                    "model (--formats default: fp16 q4_0 iq4_nl int2_g64)")
    sp.add_argument("--models", nargs="+", choices=["smollm2", "llama-1b"],
                    help="e2e: which models. CPU (default smollm2, none with --gguf): smollm2: fp32, bf16, its GGUF "
                    "imported, q4_0+q8_0 (--formats), next to llama.cpp on its bundled GGUF; llama-1b: two "
                    "Llama-3.2-1B-shaped GGUFs with random weights (speed only) written once to the cache "
                    "(0.4-0.7 GB each: Q4_0 and Q2_K linear blocks, Q8_0 tied embedding/head, SmolLM2's tokenizer), "
                    "rows as --gguf's (no fp32/bf16 rows: too slow at 1B). --device cuda: default both")
    sp.add_argument("--gguf", nargs="+", metavar="PATH",
                    help="e2e (CPU): also time these llama.cpp GGUF files (llama, qwen2, qwen3, phi3, gemma2, gemma3): llama.cpp on the "
                    "file and from_gguf's import of it (its blocks as stored, K-quants included), eager and compiled")
    sp.add_argument("--requantize", metavar="FORMAT",
                    help="e2e with --gguf / --models llama-1b: import the linear blocks other than the 32-weight block "
                    "types (K-quants, and types from_gguf does not keep) requantized to FORMAT, as "
                    "from_gguf(requantize=FORMAT) does (e.g. int2_g64 next to llama.cpp's Q2_K)")
    sp.add_argument("--ppl", action="store_true",
                    help="e2e with --gguf: also the perplexity of our import and of llama.cpp on each file, over the "
                         "same first 2048 Wikipedia tokens in windows of 512 (every next token scored for both)")
    sp.add_argument("--profile", action="store_true",
                    help="gpu: also profile each contender's eager call on the host (cProfile, first shape, M = 1); "
                         "e2e: where a decode step of each native row goes (ms/token: projections, attention, "
                         "the decoder's other C++ work, everything outside it)")
    sp.add_argument("--png", help="write the plot (cpu: roofline at the largest thread count; distortion: MSE "
                    "vs bits) to this PNG file")
    sp.set_defaults(fn=cmd_bench)


def _known_formats() -> set:
    from ..formats import formats
    return set(formats())


def bench_format_names(p: argparse.ArgumentParser, args, cpu_paths: Callable[[], list[str]]) -> list[str]:
    """The format names a bench command will quantize to (for the caller to check before any work); a
    --path this CPU cannot run is an error on the parser."""
    if args.gguf and (args.what != "e2e" or args.device != "cpu"):
        p.error("--gguf goes with bench e2e on the CPU (llama.cpp and our import of the file)")
    if args.requantize and (args.what != "e2e" or not (args.gguf or "llama-1b" in (args.models or []))):
        p.error("--requantize goes with bench e2e --gguf FILE or --models llama-1b (the GGUF imports)")
    if args.requantize:
        from ..formats import get_format
        try:
            get_format(args.requantize)
        except (KeyError, ValueError) as e:
            p.error(f"--requantize: {e}")
    if args.ppl and not args.gguf:
        p.error("--ppl goes with bench e2e --gguf FILE (perplexity needs a real model: the llama-1b files hold "
                "random weights)")
    if args.what == "e2e" and args.device == "cuda":
        names = [f for f in args.formats or [] if f != "fp16"]
    elif args.what == "e2e":
        from .e2e import variant_formats
        from .e2e_gguf import check_bench_gguf
        if args.formats and "smollm2" not in e2e_models(args):
            p.error("--formats picks SmolLM2's rows; add --models smollm2 (a GGUF file's rows are llama.cpp and "
                    "our import of it)")
        try:
            names = [f for v in args.formats or [] for f in variant_formats(v)]
            for path in args.gguf or []:
                check_bench_gguf(path)
        except ValueError as e:
            p.error(f"bench e2e: {e}")
    else:
        from .cpu import split_act_suffix
        names = [split_act_suffix(f)[0] for f in args.formats or []]
    if args.what == "gvq":
        from ..formats import GeneralVQ, get_format
        bad = [f for f in names if f in _known_formats() and not isinstance(get_format(f), GeneralVQ)]
        if bad:
            p.error(f"bench gvq times the gvq formats (gvq*, aqlm_*, gptvq2); {', '.join(bad)} is not one "
                    "(q4_0 is timed beside them anyway)")
    if args.path:
        if args.what not in ("cpu", "gvq"):
            p.error("--path goes with bench cpu and bench gvq")
        unknown = [name for name in args.path if name not in cpu_paths()]
        if unknown:
            from ..ops import cpu_model
            p.error(f"--path {' '.join(unknown)}: not a kernel path this CPU ({cpu_model()}) can run; "
                    f"choose from: {' '.join(cpu_paths())}")
    return names
