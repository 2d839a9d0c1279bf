"""`python -m torch_lowbit bench gpu`: our Triton kernels side by side with torch's fp16 F.linear on
a CUDA GPU, weights streamed from HBM.

Each contender gets enough copies of its weight to total more than `rotate_mib` (default 256 MiB,
well past an H100's 50 MB L2) and cycles through them, so every call reads its weight from HBM.
Each call is timed with CUDA events; tables show medians. GB/s is the weight's bytes over the time
(the activations and output are small next to it at these M). With `fast_hadamard_transform`
installed, its transform of [M, 4096] is timed against our Triton Hadamard kernel (ours alone without it).
A `fmt+a8` / `fmt+a4` contender wraps the layer in per-token integer activations (QuaRot), which
lut4 layouts multiply with an integer tl.dot (triton_kernels/int_act.py).

A `fmt@dequant` contender (formats without a rotation) forces the large-M route the autotuner may pick:
the layout's dequantize kernel writes W in fp16, then cuBLAS; its time minus fp16 `F.linear`'s is the
dequantize kernel's.

Every format runs in its CUDA default layout (lut4_rowmajor, stream_rowmajor for int1/2/3,
gcb_rowmajor, palette_packed). Palette formats (nuq*, vq*, tcq*, half-TCQ): the timed
call is the whole QuantLinear forward: the activations' Hadamard rotation plus the fused kernel. TCQ
weights get random code bits instead of Viterbi codes: the encoder is CPU-only at these sizes (the
pure-torch reference on a GPU holds [sequences, 2^16] costs per step), and neither the decode work
nor the bytes read depend on the code values.

The timing loop and the tables take a device and a timer, so tests run them on CPU tensors (the
Triton interpreter) without a GPU; the command itself refuses to run without CUDA.
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..formats import get_format
from ..formats.palette import TCQ, HalfTCQ
from ..layouts import default_layout
from ..nn import QuantLinear
from ..nn.act_quant import ActQuantLinear
from .cpu import act_label, split_act_suffix

GPU_BENCH_SHAPES = ((4096, 4096), (4096, 14336))  # (N out, K in)
GPU_BENCH_FORMATS = ("q4_0", "int4_g128", "iq4_nl", "nuq3", "vq2", "tcq2", "int2_g64", "gcb2")
BASELINE = "torch fp16 F.linear"


@dataclass
class GpuRow:
    shape: str
    m: int
    name: str
    us: float
    weight_bytes: int
    graph_us: Optional[float] = None  # device time per call: the calls replayed from a CUDA graph

    def weight_gbs(self) -> float:
        return self.weight_bytes / (self.us * 1e3)

    def tflops(self) -> float:
        n, k = map(int, self.shape.split("x"))
        return 2.0 * self.m * n * k / (self.us * 1e6)


def require_cuda(command: str = "bench gpu") -> None:
    if not torch.cuda.is_available():
        raise SystemExit(f"{command} needs a CUDA GPU, and torch.cuda.is_available() is False here "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); run it on a machine "
                         "with an NVIDIA GPU and a CUDA build of torch, or use `bench cpu` on this one")


def cuda_event_us(fn: Callable[[int], object], copies: int, repeats: int = 50, warmup: int = 5) -> float:
    """Median µs of fn(i) over `repeats` calls cycling through `copies` weights, CUDA events per call."""
    for i in range(warmup):  # also the autotuning calls of a shape not seen before
        fn(i % copies)
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % copies)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def cuda_graph_us(fn: Callable[[int], object], copies: int, repeats: int = 20) -> Optional[float]:
    """µs per call with the host out of the picture: one call on each of the `copies` weights captured
    into a CUDA graph (weights still streamed from HBM), the graph replayed and timed with CUDA events,
    divided by `copies`. What the kernels cost; cuda_event_us is what an eager caller waits. None when
    a contender cannot be captured (its error is printed)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
            for i in range(copies):
                fn(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(copies):
                fn(i)
    except Exception as e:  # noqa: BLE001 - reported, the eager timing stands
        print(f"  (not capturable in a CUDA graph: {type(e).__name__}: {e})", file=sys.stderr)
        return None
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return statistics.median(times)


def wall_us(fn: Callable[[int], object], copies: int, repeats: int = 3, warmup: int = 1) -> float:
    """A host-clock stand-in for cuda_event_us (CPU tensors, tests)."""
    for i in range(warmup):
        fn(i % copies)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i % copies)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _copies(nbytes: int, rotate_mib: int) -> int:
    return max(2, -(-rotate_mib * 2**20 // max(nbytes, 1)))


def _contenders(n: int, k: int, formats, rotate_mib: int, device: str):
    """name -> (make(copy index) -> (callable(x) -> y), weight bytes, copies)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    nbytes = n * k * 2
    ws = [w.to(device=device, dtype=torch.float16) for _ in range(_copies(nbytes, rotate_mib))]
    out = {BASELINE: (lambda i, ws=ws: (lambda x: F.linear(x, ws[i])), nbytes, len(ws))}
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    lin = lin.to(device)  # quantize where it runs: the formats' searches are fast on a GPU
    for spec in formats:
        spec, _, route = spec.partition("@")
        if route not in ("", "dequant"):
            raise ValueError(f"bench gpu: unknown route @{route} in {spec}@{route}; the one route is @dequant")
        fmt, act_bits, act_block = split_act_suffix(spec)
        f = get_format(fmt)
        if route and (act_bits or getattr(f, "rotate", False)):
            raise ValueError(f"bench gpu: {spec}@dequant: the dequantize route takes weight-only formats without "
                             "a rotation (the layer's op on x as it is)")
        layout = default_layout(f, "cuda")
        q = _random_tcq(f, n, k, layout, device) if isinstance(f, (TCQ, HalfTCQ)) else \
            QuantLinear.from_linear(lin, f, layout=layout)
        qbytes = q.weight_nbytes()
        label = f"torch_lowbit {spec} [{layout.name}]"
        if act_bits:  # QuaRot-style integer activations: the integer tl.dot kernel where it applies
            q = ActQuantLinear(q, act_bits, clip_ratio=0.9, block=act_block)
            label = f"torch_lowbit {spec} [{layout.name}, {act_label(act_bits, act_block)}]"
        if route:
            q = DequantRoute(q)
            label = f"torch_lowbit {spec} [{layout.name}, dequantize + cuBLAS]"
        mods = [q] + [copy.deepcopy(q) for _ in range(_copies(qbytes, rotate_mib) - 1)]
        out[label] = (lambda i, mods=mods: mods[i], qbytes, len(mods))
    return out


class DequantRoute:
    """Calls a QuantLinear's fused op with the config DEQUANT_ROUTE: its dequantize kernel, then torch.mm."""

    def __init__(self, q: QuantLinear):
        self.q = q

    def __call__(self, x):
        import importlib

        from ..triton_kernels.matmul import DEQUANT_ROUTE
        op, kernels, args = self.q.layout.op_call(self.q.fmt, self.q._buffers, x, self.q.bias)
        return getattr(importlib.import_module(f"torch_lowbit.triton_kernels.{kernels}"), op)(*args, config=DEQUANT_ROUTE)


def _random_tcq(f, n: int, k: int, layout, device: str) -> QuantLinear:
    """A TCQ QuantLinear with random code bits (see the module docstring), realistic row scales and the
    format's rotation signs."""
    problem = f.shape_problem(n, k)
    if problem is not None:
        raise ValueError(f"bench gpu: {f.name} {problem}")
    q = QuantLinear.empty(k, n, f, bias=False, layout=layout, device=device)
    gen = torch.Generator().manual_seed(0)
    for name in q._buffer_names:
        t = getattr(q, name)
        if t.dtype == torch.int32:
            t.copy_(torch.randint(-2**31, 2**31, t.shape, generator=gen, dtype=torch.int64).to(torch.int32))
    q.row_scales.fill_(0.02)
    if f.rotate:
        q.signs.copy_(f.signs(k))
    return q


@torch.no_grad()
def bench_gpu(shapes=GPU_BENCH_SHAPES, ms=(1, 8, 64, 512), formats=GPU_BENCH_FORMATS, rotate_mib: int = 256,
              device: str = "cuda", timer: Optional[Callable] = None, progress=None, graphs: bool = True) -> list[GpuRow]:
    """One row per shape x M x contender; activations fp16. graphs (CUDA): also the device time per
    call from a CUDA-graph replay (GpuRow.graph_us)."""
    timer = timer or cuda_event_us
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    rows = []
    for n, k in shapes:
        contenders = _contenders(n, k, formats, rotate_mib, device)
        for m in ms:
            x = torch.randn(m, k, device=device).half()
            for name, (make, nbytes, copies) in contenders.items():
                us = timer(lambda i: make(i)(x), copies)
                graph = cuda_graph_us(lambda i: make(i)(x), copies) if device == "cuda" and graphs else None
                rows.append(GpuRow(f"{n}x{k}", m, name, us, nbytes, graph))
                progress(f"  {n}x{k} M={m} {name}: {us:.1f} us" + (f", {graph:.1f} us in a CUDA graph" if graph else ""))
    return rows


def host_profile(fn: Callable[[], object], calls: int = 200, top: int = 12, sync: Optional[Callable] = None) -> str:
    """Where an eager call's host time goes: cProfile over `calls` calls of fn (warmed up first), the
    `top` functions by their own time, with the µs per call each costs. On CUDA the device runs
    asynchronously, so this is the launch path alone (custom-op dispatch, the Triton launcher,
    allocations); `sync` (torch.cuda.synchronize) runs once at the end, outside the profile."""
    import cProfile
    import io
    import pstats
    for _ in range(3):
        fn()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    host_us = (time.perf_counter() - t0) * 1e6 / calls
    if sync is not None:
        sync()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # (cc, nc, tottime, cumtime, callers)
    lines = [f"host time {host_us:.1f} µs per call (profiled; cProfile adds its own cost), top {top} by own time:",
             "| own µs/call | cumulative µs/call | calls/call | function |", "|---|---|---|---|"]
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{'/'.join(file.rsplit('/', 2)[-2:])}:{line}" if line else "built-in"
        lines.append(f"| {tottime * 1e6 / calls:.1f} | {cumtime * 1e6 / calls:.1f} | {ncalls / calls:.1f} | {name} ({where}) |")
    return "\n".join(lines)


def format_gpu_table(rows: list[GpuRow], device_name: str) -> str:
    lines = [f"GPU: {device_name}; fp16 activations; weights streamed from HBM; median µs per call "
             "(eager: what a caller waits, host launch included; graph: the calls replayed from a CUDA graph, "
             "device time; GB/s and TFLOPS from the eager time)", "",
             f"| W (N x K) | M | kernel | µs | graph µs | weight GB/s | TFLOPS | vs {BASELINE} | graph vs graph |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next((b for b in rows if b.shape == r.shape and b.m == r.m and b.name == BASELINE), None)
        ratio = f"{base.us / r.us:.2f}x" if base else "-"
        graph_ratio = f"{base.graph_us / r.graph_us:.2f}x" if base and base.graph_us and r.graph_us else "-"
        graph = f"{r.graph_us:.1f}" if r.graph_us else "-"
        lines.append(f"| {r.shape} | {r.m} | {r.name} | {r.us:.1f} | {graph} | {r.weight_gbs():.0f} | "
                     f"{r.tflops():.2f} | {ratio} | {graph_ratio} |")
    return "\n".join(lines)


def fast_hadamard_transform_fn():
    """fast_hadamard_transform.hadamard_transform, or None when that CUDA-only package is missing."""
    try:
        from fast_hadamard_transform import hadamard_transform
    except ImportError:
        return None
    return hadamard_transform


@torch.no_grad()
def bench_hadamard(ms=(1, 8, 64, 512), n: int = 4096, fht=None, device: str = "cuda",
                   timer: Optional[Callable] = None) -> list[list]:
    """[M, fast_hadamard_transform µs, Triton µs] rows for a [M, n] fp16 transform (no signs)."""
    import math

    from ..triton_kernels.hadamard import hadamard_transform
    timer = timer or cuda_event_us
    rows = []
    for m in ms:
        xs = [torch.randn(m, n, device=device).half() for _ in range(2)]
        ours = timer(lambda i: hadamard_transform(xs[i]), 2)
        theirs = timer(lambda i: fht(xs[i], 1.0 / math.sqrt(n)), 2) if fht is not None else None
        rows.append([m, theirs, ours])
    return rows


def format_hadamard_table(rows: list[list], n: int = 4096) -> str:
    lines = [f"Hadamard transform of [M, {n}] fp16 (median µs)", "",
             "| M | fast_hadamard_transform µs | Triton (ours) µs | ours vs fast_hadamard_transform |",
             "|---|---|---|---|"]
    for m, theirs, ours in rows:
        t = f"{theirs:.1f}" if theirs is not None else "-"
        ratio = f"{theirs / ours:.2f}x" if theirs is not None else "-"
        lines.append(f"| {m} | {t} | {ours:.1f} | {ratio} |")
    return "\n".join(lines)
