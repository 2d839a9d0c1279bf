"""Compile every Triton kernel for a real GPU target without a GPU:
`TRITON_INTERPRET=0 python -m torch_lowbit.tools.triton_compile_check [--arch 90]`.

The interpreter runs the kernels' Python semantics and accepts code a GPU compile rejects (it let a
non-constexpr global inside a jit function through); this check runs the real code generator and
ptxas (bundled with triton) down to a cubin for sm_<arch>. It drives the real launchers on meta
tensors, with every kernel attribute of the kernel modules swapped for a stand-in that compiles the
launch instead of running it, and autotune.pick swapped for one that compiles configs of each
launch's own autotune space instead of timing them: each format family x kernel kind by M
(split-K GEMV, tl.dot with and without split-K, dequantize + cuBLAS) x activation dtype,
the split-K reduction, the dequantize kernels and the Hadamard transform (`--every`: every
config of every space). It prints each distinct compile with its shared
memory and fails if any exceeds the target's per-block limit.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import torch

SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}  # bytes per block (opt-in max)
_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8",
          torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel uses, read off its cubin with the cuobjdump bundled with triton.
    stack: bytes of stack frame per thread (Triton kernels have none unless ptxas spills registers).
    loop: SASS instructions of the longest loop body (the K loop of a matmul kernel); per_weight:
    that over the weights one thread decodes per iteration (BLOCK_N * BLOCK_K / threads) — the
    static cost model of a memory-bound decode kernel (an H100 issues ~5 thread-instructions per
    q4_0 weight streamed at HBM speed). barriers: BAR.SYNCs in that loop (a layout conversion through
    shared memory each: the warps wait for each other, and loads are not hoisted across them);
    widest_load: the widest global load in it, in bytes (16: LDG.128, what streams weights at HBM
    speed with few loads in flight per thread)."""
    shared: int
    regs: int
    stack: int
    loop: int
    per_weight: Optional[float]
    barriers: int = 0
    widest_load: int = 0

    def __str__(self):
        cost = f", loop {self.loop} instr" + (f" = {self.per_weight:.1f}/weight" if self.per_weight else "")
        return (f"shared {self.shared} B, {self.regs} regs, stack {self.stack} B{cost}, {self.barriers} barriers, "
                f"loads up to {self.widest_load} B")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], check=True, capture_output=True, text=True).stdout


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest loop of a SASS listing (a branch back to an earlier address)."""
    span = (0, -1)
    for addr, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`?\(?)?0x([0-9a-f]+)", sass):
        addr, target = int(addr, 16), int(target, 16)
        if target < addr and addr - target > span[1] - span[0]:
            span = (target, addr)
    return [op for addr, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]+);", sass)
            if span[0] <= int(addr, 16) <= span[1]]


_LOAD_BYTES = {"64": 8, "128": 16, "U8": 1, "S8": 1, "U16": 2, "S16": 2}


def _load_bytes(op: str) -> int:
    """Bytes of one thread's global load (LDG.E.128 -> 16; plain LDG.E -> 4)."""
    widths = [_LOAD_BYTES[w] for w in op.split()[0].split(".")[1:] if w in _LOAD_BYTES]
    return max(widths) if widths else 4


def resources(kernel, constexprs: dict) -> Resources:
    usage = _cuobjdump(kernel.asm["cubin"], "-res-usage")
    regs, stack = (int(v) for v in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    body = loop_body(_cuobjdump(kernel.asm["cubin"], "-sass"))
    ops = [re.sub(r"^@!?U?P\w+\s+", "", op).strip() for op in body]
    loop = len(body)
    barriers = sum(op.startswith("BAR.SYNC") for op in ops)
    widest = max((_load_bytes(op) for op in ops if op.startswith("LDG")), default=0)
    per_weight = None
    if "BLOCK_N" in constexprs and "BLOCK_K" in constexprs and loop:
        per_thread = constexprs["BLOCK_N"] * constexprs["BLOCK_K"] / (32 * kernel.metadata.num_warps)
        per_weight = loop / per_thread
    return Resources(kernel.metadata.shared, regs, stack, loop, per_weight, barriers, widest)


class _CompileOnly:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` compiles instead of launching."""

    def __init__(self, fn, checker):
        self.fn, self.checker = fn, checker

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.checker.compile(self.fn, args, kwargs)


class Checker:
    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)
        self.limit = SHARED_LIMIT.get(arch, 99 * 1024)
        self.done: dict[str, Resources] = {}  # compile key -> what the compile uses

    def compile(self, fn, args, kwargs):
        import triton
        from triton.compiler import ASTSource
        bound = dict(zip(fn.arg_names, args), **kwargs)
        options = {k: bound.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in bound}
        signature, constexprs, attrs = {}, {}, {}
        for i, p in enumerate(fn.params):
            value = bound[p.name]
            if p.is_constexpr:
                signature[p.name], constexprs[p.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[p.name] = "*" + _TYPES[value.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]  # as a launch specializes CUDA allocations (256-B aligned)
            elif isinstance(value, float):
                signature[p.name] = "fp32"
            else:
                signature[p.name] = "i32"
                if value % 16 == 0:  # as a launch specializes integers divisible by 16
                    attrs[(i,)] = [["tt.divisibility", 16]]
        key = f"{fn.__name__} {sorted((k, getattr(v, '__name__', v)) for k, v in constexprs.items())} " \
              f"{sorted(signature.items())} {sorted(options.items())} {sorted(attrs)}"
        if key not in self.done:
            t0 = time.time()
            kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=self.target,
                                    options=options)
            res = resources(kernel, constexprs)
            self.done[key] = res
            consts = ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in constexprs.items())
            print(f"{fn.__name__}({consts}) {options}: {res}, {time.time() - t0:.1f} s", flush=True)


def _modules():
    from ..triton_kernels import hadamard, int_act, kquant, kv_attention, lowbit, lut4, matmul, palette
    return (matmul, lut4, lowbit, kquant, palette, hadamard, kv_attention, int_act)


def _install(checker: Checker) -> None:
    from triton.runtime.jit import JITFunction
    for module in _modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                setattr(module, name, _CompileOnly(value, checker))


def _module(fmt_name: str, n: int, k: int):
    """A meta-device QuantLinear in the format's CUDA layout (shapes and dtypes only)."""
    from ..formats import get_format
    from ..layouts import default_layout
    from ..nn import QuantLinear
    fmt = get_format(fmt_name)
    return QuantLinear.empty(k, n, fmt, bias=True, layout=default_layout(fmt, "cuda"), device="meta").to("meta")


# (format, K): every kernel family; int4_g128 has mins, iq4_nl's table is not affine, int3 straddles
# words, gcb gathers from its codebooks, vq5's table is the largest, tcq2.25 is half-TCQ, the K-quants
# (q3_k: two sub-blocks a unit, q4_k / q6_k: GGUF's most common types).
FORMATS = (("q4_0", 4096), ("int4_g128", 4096), ("iq4_nl", 4096), ("int3_g64", 4096), ("int2_g64", 4096), ("int1_g64", 4096),
           ("gcb2", 4096), ("gcb3", 4096), ("nuq3", 4096), ("vq2", 4096), ("vq5", 4096), ("tcq2", 4096),
           ("tcq2.25", 4096), ("q2_k", 4096), ("q3_k", 4096), ("q4_k", 4096), ("q5_k", 4096), ("q6_k", 4096))


# The test suite's subset (tests/kernels/triton/test_triton_compile_check.py): every kernel and decoder once — q4_0 (affine
# table, all activation dtypes), int3 (mins, straddling codes), int2 (the 16-byte-load GEMV of whole-word
# codes), gcb3 (codebook gathers), vq2 (codebook kernels, pairs; its GEMV the 16-byte-load one), half-TCQ,
# q4_k (the K-quants' 16-byte-load GEMV and tl.dot kernel) and q3_k (their unit GEMV, two sub-blocks a unit).
QUICK = (("q4_0", 4096), ("int3_g64", 4096), ("int2_g64", 4096), ("gcb3", 4096), ("vq2", 4096), ("tcq2.25", 4096),
         ("q4_k", 4096), ("q3_k", 4096))


def _variants(candidates, default, every: bool) -> list:
    """The configs to compile for one launch: the whole autotune space with `every`, else the default,
    one split-K config and the dequantize route where the space has them."""
    if every:
        return [default] + [c for c in candidates if c != default]
    out = [default]
    out += [c for c in candidates if c.get("SPLIT_K", 1) > 1][:1]
    out += [c for c in candidates if c.get("ROUTE")]
    return out


def run(arch: int = 90, formats=FORMATS, ms=(1, 16, 512), dtypes=(torch.float16,), every: bool = False) -> dict:
    """Compile the kernel launches of `formats` at these M and activation dtypes (fp32 and bf16 too on
    the first format; fp32, whose tiles are the largest, on every format at the largest M), each
    launch with _variants of its autotune space; returns {compile key: Resources}."""
    import importlib

    from ..triton_kernels import autotune
    if autotune.INTERPRET:
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset (the interpreter replaces @triton.jit)")
    checker = Checker(arch)
    _install(checker)

    def pick(kernel, key, candidates, default, run_config, device):
        for cfg in _variants(candidates, default, every):
            run_config(cfg)
        return default

    autotune.pick = pick  # the launchers' own config spaces, compiled instead of timed
    n = 4096
    from ..triton_kernels import matmul
    for i, (fmt_name, k) in enumerate(formats):
        q = _module(fmt_name, n, k)
        # the module's table is on the meta device: seed its affine form from the format's CPU values
        if "lut" in q._buffers:
            matmul.derived(q._buffers["lut"], "affine_form",
                           lambda _lut, values=q.fmt.code_values().float(): matmul.table_form(values))
        for dtype in dict.fromkeys(dtypes + (torch.float32, torch.bfloat16)):
            for m in ms if i == 0 or dtype in dtypes else ms[-1:] if dtype == torch.float32 else ():
                x = torch.empty(m, k, device="meta", dtype=dtype)
                op, kernels, args = q.layout.op_call(q.fmt, q._buffers, x, q.bias)
                getattr(importlib.import_module(f"torch_lowbit.triton_kernels.{kernels}"), op)(*args)
    from ..triton_kernels.hadamard import hadamard_transform
    for n_rot, dtype in ((4096, torch.float16), (4096, torch.bfloat16), (14336, torch.float16), (576, torch.float16)):
        for m in (1, 64):  # a power of two, and K = 7 or 9 blocks of a base order
            hadamard_transform(torch.empty(m, n_rot, device="meta", dtype=dtype),
                               torch.empty(n_rot, device="meta", dtype=torch.float32))
    from ..triton_kernels.kv_attention import kv_attention
    for bits, d, hkv, ring in ((4, 128, 8, False), (4, 64, 3, True), (8, 128, 8, False)):  # Llama-8B, SmolLM2
        meta = dict(device="meta")
        codes = torch.empty(1, hkv, 4096, d * bits // 8, dtype=torch.uint8, **meta)
        groups = torch.empty(1, hkv, 4096, 1, dtype=torch.float16, **meta)
        rings = (torch.empty(1, hkv, 128, d, **meta), torch.empty(1, hkv, 128, d, **meta),
                 torch.empty((), dtype=torch.int64, **meta)) if ring else ()
        kv_attention(torch.empty(1, 4 * hkv, 1, d, dtype=torch.float16, **meta), codes, groups, groups, codes, groups,
                     groups, torch.empty(1, 1, 1, 4096, dtype=torch.bool, **meta), d ** -0.5, bits, *rings)
    from ..triton_kernels.int_act import lut4_int_linear
    # q4_0, int4_g128, int4_pc, iq4_nl (a gathered table); the meta tables' affine forms seeded; per token
    # (A8 at small M, A4 at 512), then activation blocks of 16 / 8 (two-level) and 32
    q4 = (1.0, -8.0)
    for m, group, mins, form, bits, block in (
            (1, 32, False, q4, 8, 0), (512, 32, False, q4, 4, 0), (16, 128, True, (1.0, 0.0), 8, 0),
            (512, 4096, False, q4, 4, 0), (16, 32, False, None, 8, 0), (512, 32, False, None, 4, 0),
            (1, 32, False, q4, 4, 16), (512, 32, False, q4, 4, 16), (512, 32, False, None, 4, 8),
            (16, 128, True, (1.0, 0.0), 8, 32)):
        meta = dict(device="meta")
        scales = torch.empty(4096, 4096 // group, dtype=torch.float16, **meta)
        lut = torch.empty(16, dtype=torch.int8, **meta)
        matmul.derived(lut, "affine_form", lambda _lut, form=form: form)
        lut4_int_linear(torch.empty(m, 4096, dtype=torch.float16, **meta),
                        torch.empty(4096, 2048, dtype=torch.uint8, **meta), scales, scales if mins else None, lut,
                        group, None, bits, 0.9, block)
    too_big = {key: r.shared for key, r in checker.done.items() if r.shared > checker.limit}
    if too_big:
        raise RuntimeError(f"kernels over sm_{arch}'s {checker.limit} B of shared memory per block: {too_big}")
    return checker.done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    parser.add_argument("--every", action="store_true", help="every config of the autotune spaces (slow)")
    args = parser.parse_args(argv)
    done = run(args.arch, every=args.every)
    print(f"{len(done)} kernels compiled for sm_{args.arch}, max shared {max(r.shared for r in done.values())} B")
    return 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("compile_check: unset TRITON_INTERPRET (the interpreter replaces @triton.jit)")
    sys.exit(main())
