"""`python -m torch_lowbit bench roofline`: a roofline model of the int8-activation CPU kernels at
decode (M = 1), explaining each kernel's DRAM-streamed time as the larger of two ceilings.

- Memory ceiling: the weight's bytes over the DRAM read bandwidth measured with the same thread
  count (csrc/common/bandwidth.cpp), also given per core in bytes per cycle.
- Compute ceiling: the cost of the up-convert + vpdpbusd sequence itself, measured on a weight of
  N/4 rows whose per-thread share stays in the core's L2 (the shared L3 of a server part streams
  little faster than DRAM per core), given in cycles per 512-weight tile-block (16 rows x 32) per
  core at the clock measured by a dependent-multiply chain, and scaled to the full N.

model = call overhead + max(compute, memory), against the DRAM-streamed measurement. A kernel whose
compute ceiling lies above its memory ceiling cannot reach the DRAM roofline however the weights are
streamed: its op sequence has to get shorter (README, "Roofline model").
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from ..formats import get_format
from ..nn import QuantLinear
from .cpu import _copies, _median_us, dram_read_gbs

ROOFLINE_FORMATS = ("q4_0", "int4_g128", "int2_g64", "int2_sym_g64", "int1_g64", "gcb2", "gcb3")
TILE_BLOCK = 512  # weights per (16-row tile, 32-wide block): one pass of the kernels' inner loop


def clock_ghz(repeats: int = 5) -> float:
    """The core clock (turbo included) from a chain of dependent one-cycle steps; best of `repeats`."""
    from ..ops import cpu_extension
    probe, steps = cpu_extension().clock_probe, 200_000_000
    best = min(_timed(lambda: probe(steps)) for _ in range(repeats))
    return steps / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass
class RooflineRow:
    name: str
    bpw: float
    weight_bytes: int
    overhead_us: float  # the same call on a one-tile, one-block weight
    hot_us: float  # compute ceiling incl. overhead: L2-resident N/4-row call, scaled to N
    mem_us: float  # weight bytes / measured DRAM bandwidth
    dram_us: float  # measured, DRAM-streamed copies
    cycles_per_tile_block: float  # per core, compute ceiling
    bytes_per_tile_block: float

    @property
    def model_us(self) -> float:
        return self.overhead_us + max(self.hot_us - self.overhead_us, self.mem_us)

    @property
    def bound(self) -> str:
        return "compute" if self.hot_us - self.overhead_us > self.mem_us else "memory"


@torch.no_grad()
def bench_roofline(formats=ROOFLINE_FORMATS, n: int = 4096, k: int = 4096, threads: int = 2,
                   rotate_mib: int = 512) -> tuple[list[RooflineRow], dict]:
    """Rows per format plus the machine figures (clock GHz, DRAM GB/s and bytes/cycle per core)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ghz = clock_ghz()
        bw = dram_read_gbs(mib=max(64, 2 * rotate_mib))
        machine = {"threads": threads, "clock_ghz": ghz, "dram_gbs": bw,
                   "bytes_per_cycle_per_core": bw / (ghz * threads)}
        gen = torch.Generator().manual_seed(0)
        rows = []
        for name in formats:
            fmt = get_format(name)
            lin = torch.nn.Linear(k, n, bias=False)
            lin.weight.data = torch.randn(n, k, generator=gen) * 0.02
            ql = QuantLinear.from_linear(lin, fmt)
            quarter = QuantLinear.from_linear(torch.nn.Linear(k, n // 4, bias=False), fmt)
            tiny = QuantLinear.from_linear(torch.nn.Linear(fmt.group_size, 16, bias=False), fmt)
            nbytes = ql.weight_nbytes()
            mods = [ql] + [copy.deepcopy(ql) for _ in range(_copies(nbytes, rotate_mib) - 1)]
            x, x_tiny = torch.randn(1, k), torch.randn(1, fmt.group_size)
            overhead = _median_us(lambda i: tiny(x_tiny), 1)
            compute = 4 * max(_median_us(lambda i: quarter(x), 1, min_time=0.5) - overhead, 0.0)
            dram = _median_us(lambda i: mods[i](x), len(mods))
            tile_blocks = n * k / TILE_BLOCK
            cycles = compute * 1e-6 * ghz * 1e9 * threads / tile_blocks
            hot = overhead + compute
            rows.append(RooflineRow(f"{name} [{ql.layout.name}]", fmt.bits_per_weight(), nbytes, overhead, hot,
                                    nbytes / (bw * 1e3), dram, cycles, nbytes / tile_blocks))
    finally:
        torch.set_num_threads(saved)
    return rows, machine


def format_roofline(rows: list[RooflineRow], machine: dict, n: int = 4096, k: int = 4096) -> str:
    lines = [f"{n}x{k}, M = 1, {machine['threads']} threads; clock {machine['clock_ghz']:.2f} GHz; DRAM read "
             f"{machine['dram_gbs']:.1f} GB/s = {machine['bytes_per_cycle_per_core']:.2f} bytes/cycle per core", "",
             "| kernel | bits/weight | bytes / tile-block | compute: cycles / tile-block / core | needs bytes/cycle/core "
             "| call overhead µs | compute ceiling µs | memory ceiling µs | model µs | measured µs (DRAM) "
             "| measured / model | bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.bpw:.3f} | {r.bytes_per_tile_block:.0f} | {r.cycles_per_tile_block:.1f} | "
                     f"{r.bytes_per_tile_block / max(r.cycles_per_tile_block, 1e-9):.2f} | {r.overhead_us:.0f} | "
                     f"{r.hot_us:.0f} | {r.mem_us:.0f} | {r.model_us:.0f} | {r.dram_us:.0f} | "
                     f"{r.dram_us / r.model_us:.2f} | {r.bound} |")
    return "\n".join(lines)
