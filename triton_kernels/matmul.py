"""The decode-matmul skeleton every Triton format kernel shares (lut4.py, palette.py, lowbit.py):
program tiles, K slices, the multiply-accumulate (_fma_or_dot), the epilogue and split-K reduction,
the walk over a unit's stream words (_unit_words, _bits_at), derived tables, launch configs and the
launcher (one KernelLaunch per kind). A format file supplies its word-wise decoding kernel(s), each
serving both kinds, and a per-element tile decoder for its dequantize kernel (the generic
_group_dequant_kernel below for the group-scaled formats).

Kernel kinds, chosen by M (the number of activation rows):
- M <= GEMV_MAX_M, "gemv": CUDA-core split-K GEMV (GemLite's GEMV_SPLITK, Q-Palette's CUDA-core
  kernels). Each program owns BLOCK_N outputs and one of SPLIT_K slices of K, decodes a
  [BLOCK_N, BLOCK_K] weight tile and multiplies it with all M rows by broadcast FMAs. Why not
  tensor cores: a tl.dot tile is at least 16 rows, and at M <= 4 the 2*M flops per weight stay
  below what the CUDA cores sustain at HBM speed (H100: 3.35 TB/s / 0.5625 B per q4_0 weight ->
  6e12 weights/s -> 48 TFLOPS at M = 4 vs 67 fp32), so the kernel stays memory-bound either way
  and split-K gives enough programs to fill the GPU at small N.
- M > GEMV_MAX_M, "dot": tiled tl.dot (fp16/bf16 tensor cores, the decoded tile cast to x's dtype;
  exact fp32 products for fp32 activations). The grid's fastest axis is M, so the programs of one
  N tile run together and its weight is read from HBM once (then L2). Optional split-K for medium M
  and small N. From M >= DEQUANT_MIN_M (fp32 activations: always) the autotuner also times the
  "dequant" route: the format's dequantize kernel writes W in x's dtype, then cuBLAS (torch.addmm) —
  whichever is faster wins.
With SPLIT_K > 1 each program writes fp32 partials and `_splitk_reduce_kernel` sums them in a fixed
order (deterministic, unlike atomics), adds the bias and casts; with SPLIT_K == 1 the kernel does
that epilogue itself. Configs come from autotune.py.

Table lookups: every kernel gathers code values from global memory with an evict_last hint while
the streamed codes go evict_first, so L1 keeps the tables. (Staging a table in registers and
`tl.gather`-ing from it — VQ-LLM's codebook cache — lowers to ~10 warp shuffles per lookup on sm_90,
which the cubin cost model of tools/triton_compile_check showed costlier than an L1 hit; see README.)
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import autotune
from .autotune import INTERPRET

GEMV_MAX_M = 4  # M <= this: CUDA-core GEMV kernel; above: tl.dot kernel (see the module docstring)
DEQUANT_MIN_M = 128  # from here the autotuner also tries dequantize + cuBLAS
ACTS = (torch.float32, torch.bfloat16, torch.float16)


# -- jit pieces ------------------------------------------------------------------------------------
@triton.jit
def _lookup(table_ptr, idx):
    """table[idx] gathered from global memory, kept in L1 (evict_last)."""
    return tl.load(table_ptr + idx, eviction_policy="evict_last")


@triton.jit
def _window(first, second, o):
    """32 bits of a bit stream starting o bits into word `first` (uint32; `second` is the next word).
    (second >> 1) >> (31 - o) takes second's top o bits without a shift by 32 at o = 0."""
    return (first << o) | ((second >> 1) >> (31 - o))


@triton.jit
def _bits_at(cur, nxt, OFF: tl.constexpr, F: tl.constexpr):
    """The F-bit field at bit OFF (compile-time, MSB first) of the word pair cur, nxt (uint32)."""
    if OFF + F <= 32:
        return (cur >> (32 - OFF - F)) & ((1 << F) - 1)
    else:
        return ((cur << (OFF + F - 32)) | (nxt >> (64 - OFF - F))) & ((1 << F) - 1)


@triton.jit
def _unit_words(unit_ptr, word0, BIT: tl.constexpr, F: tl.constexpr, cur, nxt, STRIDE: tl.constexpr, G: tl.constexpr,
                ROW_WORDS, n_ok):
    """(cur, nxt): the words of a G-word unit under the F-bit field starting at bit BIT (compile-time)
    of the unit, for a walk over its fields in order — at BIT 0 the first two loaded, later the pair
    advanced (one load) when the field starts in a later word than the previous one. Unit word q is at unit_ptr + q STRIDE
    (row word word0 + q STRIDE; 0 past the row's ROW_WORDS)."""
    Q: tl.constexpr = BIT // 32
    if BIT == 0:
        cur = _row_word(unit_ptr, word0, 0, ROW_WORDS, n_ok)
        nxt = cur
        if G > 1:
            nxt = _row_word(unit_ptr, word0, STRIDE, ROW_WORDS, n_ok)
    elif Q != (BIT - F) // 32:  # the previous field started in word Q - 1: advance
        cur = nxt
        if Q + 1 < G:
            nxt = _row_word(unit_ptr, word0, (Q + 1) * STRIDE, ROW_WORDS, n_ok)
    return cur, nxt


@triton.jit
def _row_word(unit_ptr, word0, OFFSET: tl.constexpr, ROW_WORDS, n_ok):
    """Row word word0 + OFFSET of each unit as uint32 (0 past the row's end)."""
    return tl.load(unit_ptr + OFFSET, mask=n_ok & ((word0 + OFFSET) < ROW_WORDS)[None, :], other=0,
                   eviction_policy="evict_first").to(tl.uint32, bitcast=True)


@triton.jit
def _tiles(GEMV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(pid_m, pid_n, pid_k, offs_m, offs_n): GEMV grid (N tiles, K slices) with all M rows in one
    tile; tl.dot grid (M tiles fastest, so the M tiles of one N tile share its weight in L2, N, K)."""
    if GEMV:
        pid_m = 0
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
    return (pid_m, pid_n, pid_k, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N))


@triton.jit
def _k_slice(pid_k, K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[begin, end) of this program's K slice: whole BLOCK_K blocks, only the last meets K's edge (K
    and BLOCK_K in columns, or in the GEMVs' runs, words or quads)."""
    k_len = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_len
    return k_begin, tl.minimum(k_begin + k_len, K)


@triton.jit
def _acc_init(GEMV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 accumulator: [BLOCK_M, BLOCK_N] for tl.dot; [BLOCK_M, BLOCK_N, BLOCK_K] for the GEMV,
    whose products are summed over K once after the loop (_acc_total) — a per-tile sum would cost a
    cross-thread reduction (shuffles, barriers) every iteration."""
    if GEMV:
        return tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _acc_total(acc, GEMV: tl.constexpr):
    """[BLOCK_M, BLOCK_N] sums of an _acc_init accumulator."""
    if GEMV:
        return tl.sum(acc, axis=2)
    else:
        return acc


@triton.jit
def _fma_or_dot(acc, x, w, GEMV: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc += x @ w.T for x [BLOCK_M, k] in its dtype and fp32 w [BLOCK_N, k] (GEMV: the unsummed
    products [BLOCK_M, BLOCK_N, k], see _acc_init)."""
    if GEMV:  # broadcast FMAs in fp32 on the CUDA cores (and the interpreter mis-reads bf16 math)
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    elif DOT_FP32:  # fp32 activations (exact products), or bf16 under the interpreter
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    else:  # fp16/bf16 tensor cores, fp32 accumulation
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    return acc


@triton.jit
def _epilogue(acc, offs_m, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS: tl.constexpr,
              SPLIT_K: tl.constexpr):
    """SPLIT_K == 1: bias, cast, store y. Else: store this K slice's fp32 partial sums."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    off = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + off, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + off, acc, mask=mask)


@triton.jit
def _word_fma(f, x_ptr, ROW: tl.constexpr, K, M, col, ok, t, xs):
    """The 16-byte-load GEMVs' multiply-accumulate: x row ROW at columns col (shaped like the kernel's
    [BLOCK_N, ., 4] word tile with one row, so the load takes the words' register layout and
    broadcasts over the rows in registers — a 1-D or differently shaped x tile, or a sum of the x tile
    alone, costs a shared-memory layout conversion and a barrier every K step, sm_90 cubins) times the
    values f, accumulated into t; that row's x summed into xs."""
    x = tl.load(x_ptr + ROW * K.to(tl.int64) + col, mask=ok & (tl.full((1, 1, 1), ROW, tl.int32) < M),
                other=0.0).to(tl.float32)
    return t + f * x, xs + x


@triton.jit
def _word_step_zeros(BLOCK_N: tl.constexpr, QUADS: tl.constexpr):
    """One K step's (t, x sum) of the 16-byte-load GEMVs for 4 x rows, zero: t [BLOCK_N, QUADS, 4] and
    xs [1, QUADS, 4] (in the words' layout, see _word_fma), as t0, xs0, ..., t3, xs3."""
    zero = tl.zeros((BLOCK_N, QUADS, 4), dtype=tl.float32)
    zero_x = tl.zeros((1, QUADS, 4), dtype=tl.float32)
    return zero, zero_x, zero, zero_x, zero, zero_x, zero, zero_x


@triton.jit
def _word_fma_rows(f, x_ptr, K, M, col, ok, t0, xs0, t1, xs1, t2, xs2, t3, xs3, BLOCK_M: tl.constexpr):
    """_word_fma of the values f with each of the BLOCK_M (<= 4) x rows; rows past BLOCK_M keep their zeros."""
    t0, xs0 = _word_fma(f, x_ptr, 0, K, M, col, ok, t0, xs0)
    if BLOCK_M > 1:
        t1, xs1 = _word_fma(f, x_ptr, 1, K, M, col, ok, t1, xs1)
    if BLOCK_M > 2:
        t2, xs2 = _word_fma(f, x_ptr, 2, K, M, col, ok, t2, xs2)
        t3, xs3 = _word_fma(f, x_ptr, 3, K, M, col, ok, t3, xs3)
    return t0, xs0, t1, xs1, t2, xs2, t3, xs3


@triton.jit
def _gemv_accumulators(BLOCK_N: tl.constexpr, STEPS: tl.constexpr):
    """The 16-byte-load GEMVs' accumulators: fp32 zeros [BLOCK_N, STEPS], one per x row (up to 4)."""
    zero = tl.zeros((BLOCK_N, STEPS), dtype=tl.float32)
    return zero, zero, zero, zero


@triton.jit
def _gemv_epilogue(acc0, acc1, acc2, acc3, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS: tl.constexpr,
                   SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """_epilogue of the 16-byte-load GEMVs' per-row accumulators [BLOCK_N, steps] (x rows 0..BLOCK_M-1),
    each summed across its threads once."""
    row = tl.arange(0, 1)
    _epilogue(tl.sum(acc0, axis=1)[None, :], row, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS, SPLIT_K)
    if BLOCK_M > 1:
        _epilogue(tl.sum(acc1, axis=1)[None, :], row + 1, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS,
                  SPLIT_K)
    if BLOCK_M > 2:
        _epilogue(tl.sum(acc2, axis=1)[None, :], row + 2, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS,
                  SPLIT_K)
        _epilogue(tl.sum(acc3, axis=1)[None, :], row + 3, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS,
                  SPLIT_K)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, b_ptr, y_ptr, MN, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                          BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the same sum on every run
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def reduce_splits(ws, b, y, has_bias: bool) -> None:
    """y [M, N] = the sum of the split-K partials ws [SPLIT_K, M, N] in a fixed order (+ bias b)."""
    split, m, n = ws.shape
    block = 1024
    _splitk_reduce_kernel[(cdiv(m * n, block),)](ws, b, y, m * n, n, HAS_BIAS=has_bias, SPLIT_K=split, BLOCK=block)


@triton.jit
def _group_dequant_kernel(c_ptr, s_ptr, m_ptr, tbl_ptr, out_ptr, N, K, ROW_WORDS, DECODE: tl.constexpr,
                          BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """W [N, K] (in out's dtype) of a group-scaled format, one DECODE tile per program."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = DECODE(c_ptr, s_ptr, m_ptr, tbl_ptr, offs_n, k, N, K, ROW_WORDS, BITS, GROUP, HAS_MIN)
    _store_tile(out_ptr, w, offs_n, k, K, N, K)


@triton.jit
def _store_tile(out_ptr, w, offs_n, k, k_lim, N, K):
    """Store a decoded [BLOCK_N, len(k)] tile into the [N, K] output (cast to its dtype)."""
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * K + k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(offs_n[:, None] < N) & (k[None, :] < k_lim))


# -- launch configs --------------------------------------------------------------------------------
# GEMV: BLOCK_N x BLOCK_K weight tile times BLOCK_M (<= 4) rows lives in registers as a 3-D product:
# BLOCK_N * BLOCK_K / threads <= 32 values per row and thread.
_GEMV_TILES = ((16, 256, 4), (32, 128, 4), (32, 256, 4), (64, 64, 4), (32, 256, 8), (64, 128, 8))
_DOT_TILES = ((16, 64, 128, 4), (16, 128, 64, 4), (32, 64, 64, 4), (32, 128, 64, 4), (64, 64, 64, 4),
              (64, 128, 64, 4), (128, 64, 64, 4), (128, 128, 64, 8), (128, 256, 64, 8))
# The word-wise decoders' tl.dot space (lut4, codebook, TCQ kernels), (BLOCK_M, BLOCK_N, BLOCK_K,
# num_warps, num_stages): pipelining the code words (2 stages) holds BLOCK_N x BLOCK_K codes in
# shared memory, so the wide tiles take 1; BLOCK_K rounds up to each kernel's k_unit.
WORD_DOT_TILES = ((16, 64, 128, 4, 2), (16, 128, 128, 8, 1), (32, 64, 128, 4, 2), (64, 64, 128, 4, 1),
                  (64, 128, 128, 8, 1), (128, 128, 128, 8, 1))
# The tiles of the 16-byte-load GEMVs of whole-word codes (lowbit._lowbit_gemv_kernel,
# palette._codebook_gemv_kernel; lut4's has its own, in runs) as (BLOCK_N, quads of 4 words a row and K step, num_warps): 4-16
# quads (with 32 the x tiles get a layout of their own again, converted through shared memory); the x
# of a quad serves every row a thread holds: 2-4 rows a thread, fewer where 4 x rows' accumulators
# would spill. quad_tiles turns them into (BLOCK_N, BLOCK_K, num_warps) for a kernel's columns per quad.
QUAD_GEMV_TILES = ((64, 4, 4), (128, 4, 4), (64, 8, 4), (128, 8, 8), (32, 4, 4), (128, 16, 8))


def quad_tiles(cols_per_quad: int) -> tuple:
    """QUAD_GEMV_TILES with BLOCK_K in columns (a quad of 4 words holds cols_per_quad columns)."""
    return tuple((bn, quads * cols_per_quad, w) for bn, quads, w in QUAD_GEMV_TILES)


_SPLITS = (1, 2, 4, 8)
DEQUANT_ROUTE = {"ROUTE": "dequant"}


def kernel_kind(m: int) -> str:
    """'gemv' (CUDA-core split-K) for M <= GEMV_MAX_M, else 'dot' (tiled tl.dot)."""
    return "gemv" if m <= GEMV_MAX_M else "dot"


@dataclass(frozen=True)
class KernelLaunch:
    """How one kernel kind (kernel_kind(M): "gemv" / "dot") of a format is launched:
    kernel(x, *weights, bias, y, ws, M, N, K, *sizes, HAS_BIAS, SPLIT_K, [GEMV, DOT_FP32,] **consts,
    BLOCK_M, BLOCK_N, BLOCK_K) — kind_flags: it takes GEMV and DOT_FP32 (kernels serving both kinds).
    tiles: its autotune space, None: the generic one of the kind — gemv (BLOCK_N, BLOCK_K, num_warps),
    dot (BLOCK_M, BLOCK_N, BLOCK_K, num_warps[, num_stages]); default: its untimed tile — gemv
    (BLOCK_N, BLOCK_K, num_warps), dot (BLOCK_N, BLOCK_K, num_warps, num_stages), BLOCK_M by M;
    k_unit: the columns one step of its K loop covers (BLOCK_K rounds up to a multiple)."""
    kernel: object
    weights: tuple
    consts: dict
    sizes: tuple = ()
    kind_flags: bool = True
    tiles: Optional[tuple] = None
    default: Optional[tuple] = None
    k_unit: int = 1


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division (triton.cdiv is a constexpr function on recent Triton: slow to call
    from Python, and launch paths call it several times per decode step)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_k(bk: int, k_unit: int) -> int:
    return cdiv(bk, k_unit) * k_unit


def _unique(configs: list) -> list:
    return list({tuple(sorted(c.items())): c for c in configs}.values())  # k_unit may merge tiles


def gemv_candidates(m, n, k, tiles=None, k_unit=1):
    out = []
    for bn, bk, w in tiles or _GEMV_TILES:
        bk = _round_k(bk, k_unit)
        out += [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=2)
                for sk in _SPLITS if sk == 1 or sk * bk <= k]
    return _unique(out)


def gemv_default(m, n, k, tile=None, k_unit=1):
    # A few K slices even on small shapes, so the interpreter tests exercise the split-K reduction.
    bn, bk, w = tile or (32, 64, 4)
    bk = _round_k(bk, k_unit)
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=max(1, min(4, cdiv(k, bk))), num_warps=w, num_stages=2)


def dot_candidates(m, n, k, tiles=None, k_unit=1):
    # Split K only while the M x N tiles alone are too few to fill a GPU (M <= 64).
    out = []
    for bm, bn, bk, w, *stages in tiles or _DOT_TILES:
        bk = _round_k(bk, k_unit)
        if bm <= max(16, autotune.m_bucket(m)):
            out += [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=(stages or [3])[0])
                    for sk in (_SPLITS[:3] if m <= 64 else (1,)) if sk == 1 or sk * bk <= k]
    return _unique(out)


def dot_default(m, n, k, tile=None, k_unit=1):
    bm = 16 if m <= 16 else 32 if m <= 32 else 64  # GPU-valid tl.dot tiles (M, N, K >= 16)
    bn, bk, w, stages = tile or (64, 64, 4, 3)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=_round_k(bk, k_unit), SPLIT_K=1, num_warps=w, num_stages=stages)


PIPELINED_WEIGHT_BYTES = 96 * 1024


def _stages_that_fit(cfg: dict) -> dict:
    """One stage for a tl.dot tile whose pipelined decoded weights (stages x BLOCK_N x BLOCK_K x 2 B)
    pass PIPELINED_WEIGHT_BYTES: with the x tiles and layout conversions beside them such a config
    overran sm_90's 227 KiB on Triton 3.6 (vq2.5 at BLOCK_K 1024: 264 KiB; int1 at 512: 304 KiB).
    The tile's K loop keeps its length; only the copy-ahead goes."""
    if cfg.get("num_stages", 1) > 1 and cfg["num_stages"] * cfg["BLOCK_N"] * cfg["BLOCK_K"] * 2 > PIPELINED_WEIGHT_BYTES:
        return dict(cfg, num_stages=1)
    return cfg


def config_space(m, n, k, launch: KernelLaunch, x_dtype=torch.float16) -> tuple[list, dict]:
    """See _config_space; remembered per shape and launch space, so a decode step's launch does not
    rebuild ~20 candidate dicts (the returned lists and dicts are shared: callers copy before changing)."""
    return _config_space(m, n, k, launch.tiles, launch.default, launch.k_unit, x_dtype)


@functools.lru_cache(maxsize=4096)
def _config_space(m, n, k, tiles, default_tile, k_unit, x_dtype) -> tuple[list, dict]:
    """(candidates, untimed default) for a call with M = m: the kind's tiles, and from DEQUANT_MIN_M
    the dequantize + cuBLAS route. fp32 activations run the tl.dot kind in one stage (with two, the
    pipeliner stages their fp32 x tiles and exact table gathers through shared memory, 168-270 KiB
    at BLOCK_K 512; sm_90 has 227) and may take the route at any M: an exact fp32 tl.dot runs as
    FMAs on the CUDA cores, where cuBLAS's fp32 GEMM is hard to beat."""
    gemv = kernel_kind(m) == "gemv"
    space = (gemv_candidates, gemv_default) if gemv else (dot_candidates, dot_default)
    cands = space[0](m, n, k, tiles, k_unit)
    default = space[1](m, n, k, default_tile, k_unit)
    if not gemv:  # the untimed default must run everywhere; the autotuner skips candidates a GPU rejects
        default = _stages_that_fit(default)
    if not gemv and x_dtype == torch.float32:
        cands = _unique([dict(c, num_stages=1) for c in cands])
        default = dict(default, num_stages=1)
    if not gemv and (m >= DEQUANT_MIN_M or x_dtype == torch.float32):
        cands = cands + [dict(DEQUANT_ROUTE)]
    return cands, default


# -- tables derived from a format's tensors -------------------------------------------------------
_derived: dict = {}  # (id(tensor), name) -> (weakref to it, its _version, derived value)


def derived(t: torch.Tensor, name: str, make: Callable[[torch.Tensor], object]):
    """make(t), computed once per tensor and version (a kernel's view of a format table: its affine
    form, a pair table), so a decode step launches no table-building work after the first."""
    hit = _derived.get((id(t), name))
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    value = make(t)
    if len(_derived) > 4096:  # dead tensors' entries
        for key in [key for key, (ref, _, _) in _derived.items() if ref() is None]:
            del _derived[key]
    _derived[(id(t), name)] = (weakref.ref(t), t._version, value)
    return value


def _affine_form(table) -> Optional[tuple]:
    values = table.detach().double().cpu().reshape(-1).tolist()
    a, b = values[1] - values[0], values[0]
    return (float(a), float(b)) if all(v == a * c + b for c, v in enumerate(values)) else None


def table_form(table) -> Optional[tuple]:
    """(A, B) when table[c] == A c + B for every code (q4_0: (1, -8), int4_g*: (1, 0), int2_sym:
    (2, -3)), else None (iq4_nl). Read from the tensor once (one device sync on its first call),
    then remembered per tensor and version (derived)."""
    return derived(table, "affine_form", _affine_form)


def pair_table(table: torch.Tensor) -> torch.Tensor:
    """int64 [v^2] of a table's v values: entry a * v + c holds the fp32 values table[a] (low word)
    and table[c] (high word), so a GEMV looks up two codes' weights with one 8-byte load."""
    t = table.reshape(-1).float()
    pairs = torch.stack([t[:, None].expand(-1, t.numel()), t[None, :].expand(t.numel(), -1)], -1)
    return pairs.reshape(-1, 2).contiguous().view(torch.int64)


# -- checks ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The GPU's SM count (cached: the launch path is host-bound), or an H100's 132 off CUDA (the
    interpreter and the meta-device compile check size their grids as for one)."""
    if device.type != "cuda":
        return 132
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def check_device(op, ref_name, ref, tensors):
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{op} (triton): {name} is on {t.device} but {ref_name} is on {ref.device}; move "
                             "the module or the input with .to()")
    if ref.device.type == "cpu" and not INTERPRET:
        raise RuntimeError(f"{op} (triton): CPU tensors run only under the Triton interpreter; set "
                           "TRITON_INTERPRET=1 before importing torch_lowbit, or move the tensors to CUDA")


def check_x(op, x, k, n, bias):
    if x.dtype not in ACTS:
        raise TypeError(f"{op} (triton): activations must be float32, bfloat16 or float16, got {x.dtype}; "
                        "cast them with .to(torch.float16) or similar")
    if x.shape[-1] != k:
        raise ValueError(f"{op} (triton): x has {x.shape[-1]} features, the weight has K={k}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"{op} (triton): bias must have {n} elements, got {tuple(bias.shape)}")


# -- launcher --------------------------------------------------------------------------------------
def linear_launch(op: str, x, n: int, launches: dict, bias, key: str, config,
                  dequantize: Callable[[torch.dtype], torch.Tensor]):
    """y = x @ W.T + bias in x's dtype, any leading dims of x, through launches[kernel_kind(M)] (a
    KernelLaunch), its config from autotune.pick under `op` and `key` — or, for the config
    DEQUANT_ROUTE, dequantize(x.dtype) -> W [N, K] and cuBLAS.
    config: force a launch config (tests, benchmarks; BLOCK_K rounds up to the kernel's k_unit);
    default: autotune.pick (the fixed default without a GPU
    timer, the tuned one on CUDA)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    # The interpreter stores bf16 by truncation: give it an fp32 output and round once on the host.
    out_dtype = torch.float32 if INTERPRET and x.dtype == torch.bfloat16 else x.dtype
    y = torch.empty((m, n), device=x.device, dtype=out_dtype)
    if m == 0:
        return y.to(x.dtype).reshape(*x.shape[:-1], n)
    kind = kernel_kind(m)
    launch = launches[kind]
    b = bias.contiguous() if bias is not None else x2  # any pointer: HAS_BIAS is off

    def run(cfg, warmup=False):
        """Launch with cfg; warmup: only compile its kernel (autotune.precompile)."""
        cfg = dict(cfg)
        if cfg.get("ROUTE") == "dequant":
            if warmup:
                return
            w_t = dequantize(x2.dtype).t()
            target = y if y.dtype == x2.dtype else torch.empty_like(y, dtype=x2.dtype)
            if bias is None:
                torch.mm(x2, w_t, out=target)
            else:
                torch.addmm(bias.to(x2.dtype), x2, w_t, out=target)
            if target is not y:
                y.copy_(target)
            return
        cfg["BLOCK_K"] = _round_k(cfg["BLOCK_K"], launch.k_unit)
        split = cfg.pop("SPLIT_K")
        # fp32 partials of each K slice (every element written: no zero-fill needed)
        ws = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else y
        if kind == "gemv":
            grid = (cdiv(n, cfg["BLOCK_N"]), split)
            cfg["BLOCK_M"] = next_power_of_2(m)
        else:
            grid = (cdiv(m, cfg["BLOCK_M"]), cdiv(n, cfg["BLOCK_N"]), split)
        if launch.kind_flags:
            cfg["GEMV"] = kind == "gemv"
            cfg["DOT_FP32"] = x2.dtype == torch.float32 or (INTERPRET and x2.dtype == torch.bfloat16)
        kernel = launch.kernel.warmup if warmup else launch.kernel[grid]
        kernel(x2, *launch.weights, b, y, ws, m, n, k, *launch.sizes, HAS_BIAS=bias is not None and split == 1,
               SPLIT_K=split, **launch.consts, **cfg, **({"grid": grid} if warmup else {}))
        if split > 1 and not warmup:
            reduce_splits(ws, b, y, bias is not None)

    if config is None:
        cands, default = config_space(m, n, k, launch, x2.dtype)
        full_key = f"m{autotune.m_bucket(m)}_n{n}_k{k}_{key}_{str(x.dtype).removeprefix('torch.')}"
        config = autotune.pick(f"{op}_{kind}", full_key, cands, default, run, x.device)
    run_fitting(run, config, (op, kind, key, x2.dtype), launch.k_unit)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# -- configs that do not fit a GPU -----------------------------------------------------------------
_fitted: dict = {}  # (op, kind, format key, dtype, config) -> the smaller config that compiled and fit


def smaller_config(cfg: dict, k_unit: int = 1) -> Optional[dict]:
    """The next config to try after `cfg` ran out of shared memory or registers: one pipeline stage,
    then half the K block (whole k_units, at least 16 for tl.dot), then half the N block, then half
    the M block (at least 16); None when nothing is left to shrink."""
    if cfg.get("num_stages", 1) > 1:
        return dict(cfg, num_stages=1)
    bk = cfg["BLOCK_K"] // 2
    if bk >= 16 and bk % k_unit == 0:
        return dict(cfg, BLOCK_K=bk)
    if cfg["BLOCK_N"] > 16:
        return dict(cfg, BLOCK_N=cfg["BLOCK_N"] // 2)
    if cfg.get("BLOCK_M", 16) > 16:
        return dict(cfg, BLOCK_M=cfg["BLOCK_M"] // 2)
    return None


def run_fitting(run: Callable[[dict], object], config: dict, memo: tuple, k_unit: int = 1) -> None:
    """run(config), stepping down through smaller_config while the GPU rejects it (Triton raises
    OutOfResources at launch, before any work: a tile's pipelined stages need more shared memory than
    the GPU has — how much depends on the Triton version and the GPU, e.g. 227 KiB on sm_90, 99 KiB
    on sm_86). The config that fit is remembered per (memo, config), so later calls launch it directly.
    The route to cuBLAS has nothing to shrink."""
    def key():  # built only when some config did not fit: this runs on every decode-step launch
        return memo + (tuple(sorted(config.items())),)

    cfg = _fitted.get(key(), config) if _fitted else config
    while True:
        try:
            run(cfg)
            return
        except OutOfResources as err:
            smaller = None if cfg.get("ROUTE") else smaller_config(cfg, k_unit)
            if smaller is None:
                raise RuntimeError(f"{memo[0]} (triton): no launch config down from {config} fits this GPU "
                                   f"({err}); pass a smaller config") from err
            cfg = _fitted[key()] = smaller


def dequant_launch(kernel, n: int, k: int, args: tuple, consts: dict, device, dtype=torch.float32,
                   block_n: int = 32, block_k: int = 64):
    """W [N, K] in `dtype` from kernel(*args, out, N, K, **consts, BLOCK_N, BLOCK_K), one tile a program.
    Compiled without FMA contraction: the reference dequantizers round value * scale before adding
    the min, and the kernels must match them bit for bit."""
    out = torch.empty((n, k), device=device, dtype=dtype)
    kernel[(cdiv(n, block_n), cdiv(k, block_k))](*args, out, n, k, **consts, BLOCK_N=block_n,
                                                                BLOCK_K=block_k, enable_fp_fusion=False)
    return out
