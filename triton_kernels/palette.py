"""Fused decode-matmul for the palette_packed layout (Q-Palette nuq*, vq*, tcq*, half-TCQ):
y = x' @ W'.T + bias with x' the already rotated activations and W'[n, :] = row_scale[n] * decoded
codes of row n, decoded in registers right after the load (W' is never materialized).

The bit layouts and scalar decoders are csrc/common/palette.h's; the kernels read them as is:
- codebook (nuq: 1 weight per code, vq: 2): b-bit codes dealt round-robin to 16 MSB-first bit
  streams per row, word w of stream l at row word 16 w + l (`stream_code`); a code indexes the
  fp32 table [2^b, d] the format hands over.
- TCQ: int32 [N/16, K/16, 4 s], one tail-biting sequence per 16 x 16 tile (row-major inside the
  tile); step t's state is the 16-bit window at bit t * s (`tcq_state`), its pair of weights the
  signed table's entry (h >> (15 - Q)) mod 2^(Q+1), h = state * (state + 1) mod 2^16 (`tcq_value`).
  half-TCQ: two such code tensors (own s, Q and table), one per half of K, in one launch.

Kernel kinds by M (split-K CUDA-core GEMV, tiled tl.dot, dequantize + cuBLAS), configs, split-K and
the launcher are matmul.py's.
The row scale multiplies each output once in the epilogue (sum_k s w x = s sum_k w x), not every
weight: cheaper, and on the tensor cores the decoded tile is cast to x's dtype unscaled (nuq's
int8-grid levels are exact in fp16 and bf16).

Decoding reads whole words, never a per-code address (the cost model of tools/triton_compile_check: per weight a
thread issues ~5 instructions where the per-element decoders took 20-45):
- codebook: _codebook_linear_kernel, both kinds (the GEMV's FMAs or one tl.dot per lookup field).
  A unit is the G words of one stream holding a whole number of codes, so every code's bits sit at
  compile-time shifts. Tables are read from global memory (L1-resident, evict_last, while the
  streamed codes go evict_first) as 8-byte entries of two fp32 values: vq pairs, or for nuq codes
  of <= PAIR_MAX_BITS two consecutive codes of a stream through a pair table (matmul.pair_table).
  (Staging the tables in registers and tl.gather-ing lowers to ~10 shuffles per lookup: slower.)
- TCQ: _tcq_linear_kernel, both kinds: a thread decodes a row's 8 steps of a 16 x 16 tile from its
  sequence words, shifted once per row to a byte-aligned start; each step is a pair of columns of
  the signed table (one 8-byte load). The dequantize kernels keep the per-element decoders.
Open risk the static model does not see (no GPU has timed these kernels yet): a warp's table gather
takes one L1 wavefront per distinct 128 B line, so tables of many lines — vq4 / vq5 (2 / 8 KiB),
TCQ's signed tables (2^(Q+1) x 8 B: 8 KiB for tcq2) — may bind on L1 rather than on issue slots.
Shared-memory lookups (QTIP keeps its hybrid-code table there) are the next step if they do.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from torch_lowbit.core import tcq_codes as tcq

from .matmul import (WORD_DOT_TILES, KernelLaunch, _acc_init, _acc_total, _bits_at, _epilogue, _fma_or_dot,
                     _gemv_accumulators, _gemv_epilogue, _k_slice, _lookup, _store_tile, _tiles, _unit_words,
                     _window, _word_fma, _word_step_zeros,
                     check_device, check_x, dequant_launch, derived, linear_launch, pair_table, quad_tiles)

# The 1mad code's constants (torch_lowbit/core/tcq_codes.py); jit code reads only constexpr globals.
_MAD_A0, _MAD_A1 = (tl.constexpr(a) for a in tcq.MAD_MULTIPLIERS)
_MAD_B0, _MAD_B1 = (tl.constexpr(b) for b in tcq.MAD_INCREMENTS)
_MAD_OFFSET = tl.constexpr(tcq.MAD_OFFSET)
_MAD_UNIT = tl.constexpr(tcq.MAD_UNIT)
STREAMS = 16  # bit streams per codebook row (palette.h kCodeStreams)
TILE = 16  # TCQ tiles are 16 x 16 (palette.h kTcqTile)
# nuq codes up to this wide are looked up two at a time in a 2^(2 b)-entry pair table (8 B entries).
# A warp's gather from global memory costs one L1 wavefront per distinct 128 B line it touches: a
# pair table of <= 4 lines (nuq3: 512 B) halves the loads for at most 2 wavefronts per weight; nuq4's
# (2 KiB, 16 lines) would cost ~8, so it reads its 64 B table once per code.
PAIR_MAX_BITS = 3

# The GEMV kernels' (BLOCK_N, BLOCK_K, num_warps) spaces. Their cost model (tools/triton_compile_check): the x
# values a thread loads are shared by the rows it holds (BLOCK_N * BLOCK_K / threads / K step per
# unit), so the tiles are taller than the generic kernels'; codebook BLOCK_K rounds up to whole units.
_CODEBOOK_GEMV_TILES = ((32, 256, 4), (64, 256, 4), (32, 512, 4), (64, 512, 8), (128, 256, 8))
_TCQ_GEMV_TILES = ((64, 128, 4), (128, 64, 4), (128, 128, 4), (256, 64, 4), (128, 128, 8), (64, 256, 4))


# -- decoders (palette.h, vectorized) -------------------------------------------------------------
@triton.jit
def _stream_codes(words_ptr, offs_n, j, N, C, ROW_WORDS, BITS: tl.constexpr):
    """uint32 codes [BLOCK_N, len(j)] of rows offs_n, code indices j (palette.h stream_code)."""
    mask = (offs_n[:, None] < N) & (j[None, :] < C)
    lane = j % 16
    pos = (j // 16) * BITS
    w = pos // 32
    o = (pos % 32).to(tl.uint32)[None, :]
    row = words_ptr + offs_n[:, None].to(tl.int64) * ROW_WORDS
    nxt = (w + 1) * 16 + lane  # only read where a code straddles two words; past the row it is 0
    first = tl.load(row + (w * 16 + lane)[None, :], mask=mask, other=0,
                    eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    second = tl.load(row + nxt[None, :], mask=mask & (nxt[None, :] < ROW_WORDS), other=0,
                     eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    return _window(first, second, o) >> (32 - BITS)


@triton.jit
def _codebook_tile(words_ptr, table, offs_n, k0, N, K, ROW_WORDS, BITS: tl.constexpr, D: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """Unscaled fp32 weights [BLOCK_N, BLOCK_K] of columns k0 .. k0 + BLOCK_K (k0 a multiple of D);
    table: the pointer of the fp32 [2^BITS, D] table."""
    j = k0 // D + tl.arange(0, BLOCK_K // D)
    codes = _stream_codes(words_ptr, offs_n, j, N, K // D, ROW_WORDS, BITS).to(tl.int32)
    if D == 1:
        w = _lookup(table, codes)
    else:  # one code per pair: both coordinates of its entry, interleaved back into columns
        w = tl.interleave(_lookup(table, 2 * codes), _lookup(table, 2 * codes + 1))
    return w


@triton.jit
def _tcq_tile(codes_ptr, tbl_ptr, offs_n, k0, k_lim, N, KP, S: tl.constexpr, Q: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """Unscaled fp32 weights [BLOCK_N, BLOCK_K] of columns k0 .. (k0 even) of one TCQ code tensor
    [N/16, KP/16, 4 S]; pairs at columns >= k_lim read nothing."""
    k = k0 + 2 * tl.arange(0, BLOCK_K // 2)  # each trellis step is a pair of adjacent columns
    mask = (offs_n[:, None] < N) & (k[None, :] < k_lim)
    seq = (offs_n[:, None] // 16).to(tl.int64) * (KP // 16) + (k // 16)[None, :]
    t = (offs_n[:, None] % 16) * 8 + (k % 16)[None, :] // 2  # step: the tile is row-major
    pos = t * S
    w = pos // 32
    base = codes_ptr + seq * (4 * S)
    first = tl.load(base + w, mask=mask, other=0, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    second = tl.load(base + (w + 1) % (4 * S), mask=mask, other=0,  # tail-biting
                     eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    state = _window(first, second, (pos % 32).to(tl.uint32)) >> 16
    if Q == 0:  # the computed 1mad code
        w_even, w_odd = _mad_pair(state)
        return tl.interleave(w_even, w_odd)
    h = (state * (state + 1)) & 0xFFFF
    idx = ((h >> (15 - Q)) & ((2 << Q) - 1)).to(tl.int32)
    # the table (2^(Q+1) x 2, 16-64 KiB) is too large to stage in registers: keep it in L1
    return tl.interleave(tl.load(tbl_ptr + 2 * idx, eviction_policy="evict_last"),
                         tl.load(tbl_ptr + 2 * idx + 1, eviction_policy="evict_last"))


@triton.jit
def _mad_coordinate(state, a: tl.constexpr, b: tl.constexpr):
    """(bytesum((a * state + b) mod 2^32) - 510) / 128: one coordinate of the 1mad code (formats/tcq.py)."""
    z = state.to(tl.uint32) * tl.full((), a, tl.uint32) + tl.full((), b, tl.uint32)  # mod 2^32
    total = (z & 0xFF) + ((z >> 8) & 0xFF) + ((z >> 16) & 0xFF) + (z >> 24)
    return (total.to(tl.int32) - _MAD_OFFSET).to(tl.float32) * _MAD_UNIT


@triton.jit
def _mad_pair(state):
    """The 1mad code's two weights of a 16-bit state (uint32)."""
    return _mad_coordinate(state, _MAD_A0, _MAD_B0), _mad_coordinate(state, _MAD_A1, _MAD_B1)


@triton.jit
def _pair_at(tbl_ptr, idx):
    """(low, high) fp32 halves of the int64 table entry idx: two values in one 8-byte L1 load."""
    entry = tl.load(tbl_ptr + idx, eviction_policy="evict_last")
    return entry.to(tl.int32).to(tl.float32, bitcast=True), (entry >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _pick(a0, a1, a2, a3, q: tl.constexpr):
    """The q-th of four values (q a compile-time index)."""
    if q == 0:
        return a0
    elif q == 1:
        return a1
    elif q == 2:
        return a2
    else:
        return a3


@triton.jit
def _codebook_linear_kernel(x_ptr, words_ptr, tbl_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, ROW_WORDS,
                            BITS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, PAIR: tl.constexpr,
                            GEMV: tl.constexpr, DOT_FP32: tl.constexpr, HAS_BIAS: tl.constexpr,
                            SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """nuq/vq, both kinds (GEMV FMAs, or one tl.dot per lookup field), from whole stream words.
    A unit is G = BITS / gcd(BITS, 32) consecutive words of one stream (row words 16 (g G + q) + l
    for stream l): CODES = 32 G / BITS whole codes, so every code's bit position is a compile-time
    constant and a thread cuts them out with fixed shifts, never a per-code address. 16 streams x
    one unit cover GROUP_COLS = 16 CODES D columns (BLOCK_K a multiple of it). A lookup reads one
    entry of tbl_ptr per F-bit field: vq (D = 2) one code -> its pair (an int64: both fp32 in one
    load); nuq with PAIR two consecutive codes of a stream (columns 16 apart) -> a pair-table entry;
    else one code -> one fp32. The row scale multiplies each output once (_scaled_epilogue)."""
    CODES: tl.constexpr = 32 * G // BITS
    P: tl.constexpr = 2 if PAIR else 1  # codes per lookup
    F: tl.constexpr = P * BITS  # bits per lookup
    GROUP_COLS: tl.constexpr = 16 * CODES * D
    U: tl.constexpr = 16 * (BLOCK_K // GROUP_COLS)  # units (stream x group) per row and K step
    pid_m, pid_n, pid_k, offs_m, offs_n = _tiles(GEMV, BLOCK_M, BLOCK_N)
    k_begin, k_end = _k_slice(pid_k, K, SPLIT_K, BLOCK_K)
    u = tl.arange(0, U)
    unit_word = (u // 16) * (16 * G) + u % 16  # each unit's first row word, from the K step's first
    unit_col = (u // 16) * GROUP_COLS + (u % 16) * D  # column of each unit's first code
    n_ok = (offs_n < N)[:, None]
    m_ok = (offs_m < M)[:, None]
    row_words = words_ptr + offs_n[:, None].to(tl.int64) * ROW_WORDS
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * K
    acc = _acc_init(GEMV, BLOCK_M, BLOCK_N, U)
    for k0 in range(k_begin, k_end, BLOCK_K):
        word0 = (k0 // GROUP_COLS) * (16 * G) + unit_word
        unit_ptr = row_words + word0[None, :]
        x_unit = x_rows + (k0 + unit_col)[None, :]
        cur, nxt = 0, 0  # the unit's words, loaded at its first field
        for i in tl.static_range(CODES // P):
            cur, nxt = _unit_words(unit_ptr, word0, i * F, F, cur, nxt, 16, G, ROW_WORDS, n_ok)
            code = _bits_at(cur, nxt, (i * F) % 32, F).to(tl.int32)
            if PAIR or D == 2:  # two fp32 values in one int64 table entry
                w0, w1 = _pair_at(tbl_ptr, code)
            else:
                w0 = tl.load(tbl_ptr + code, eviction_policy="evict_last")
                w1 = w0
            # columns of the field's values: D consecutive ones for vq, two codes 16 apart for a pair
            col0 = 16 * D * P * i
            col1 = col0 + (16 if PAIR else 1)
            x0 = tl.load(x_unit + col0, mask=m_ok & ((k0 + unit_col + col0) < k_end)[None, :], other=0.0)
            acc = _fma_or_dot(acc, x0, w0, GEMV, DOT_FP32)
            if PAIR or D == 2:
                x1 = tl.load(x_unit + col1, mask=m_ok & ((k0 + unit_col + col1) < k_end)[None, :], other=0.0)
                acc = _fma_or_dot(acc, x1, w1, GEMV, DOT_FP32)
    _scaled_epilogue(_acc_total(acc, GEMV), offs_m, offs_n, pid_k, M, N, s_ptr, b_ptr, y_ptr, ws_ptr, HAS_BIAS,
                     SPLIT_K)


@triton.jit
def _field_fma(v0, v1, x_ptr, ROW: tl.constexpr, K, M, col0, col1, TWO: tl.constexpr, w_ok, t, xs):
    """One x row's products with a lookup field's value(s): v0 at columns col0, and with TWO v1 at
    col1 (vq's pair, or nuq's second code), columns past K (the streams' padding) masked."""
    t, xs = _word_fma(v0, x_ptr, ROW, K, M, col0, w_ok & (col0 < K), t, xs)
    if TWO:
        t, xs = _word_fma(v1, x_ptr, ROW, K, M, col1, w_ok & (col1 < K), t, xs)
    return t, xs


@triton.jit
def _codebook_gemv_kernel(x_ptr, words_ptr, tbl_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, ROW_WORDS,
                          HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr,
                          G: tl.constexpr, PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """The GEMV kind (M <= 4) of nuq/vq codes in units of G <= 5 words and <= 16 lookups (nuq1-4, vq2,
    vq3, vq4, vq5; the launcher routes the rest to _codebook_linear_kernel), laid out for the memory
    system as lowbit._lowbit_gemv_kernel is: a thread owns one unit of 4 consecutive streams l of a
    group g — unit word j of stream l is row word 16 (g G + j) + l, so the
    4 streams' word j is one 16-byte load (G of them) — and cuts every lookup field of its units at
    compile-time offsets (a field straddling words j, j + 1 joins them); field i of stream l holds
    column g GROUP_COLS + 16 D P i + l D. Each field's value tile times x loaded in the words' layout
    (matmul._word_fma), columns past K (the streams' padding) masked; the row scale once at the end.
    No shared memory or barrier in the K loop (sm_90 cubins)."""
    tl.static_assert(G <= 5, "units of at most 5 words (b / gcd(b, 32) for b <= 10)")
    CODES: tl.constexpr = 32 * G // BITS
    P: tl.constexpr = 2 if PAIR else 1  # codes per lookup
    F: tl.constexpr = P * BITS  # bits per lookup
    TWO: tl.constexpr = PAIR or D == 2  # two values per lookup
    GROUP_COLS: tl.constexpr = 16 * CODES * D
    QUADS: tl.constexpr = BLOCK_K // (4 * CODES * D)  # 4 streams' units a quad, 4 quads a group
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < N)[:, None, None]
    stream_words = ROW_WORDS // 16  # a stream's words: its last unit may be cut short (K ragged)
    row_quads = tl.cdiv(stream_words, G) * 4
    q_begin, q_end = _k_slice(pid_k, row_quads, SPLIT_K, QUADS)  # in quads
    rows = offs_n[:, None, None].to(tl.int64) * ROW_WORDS
    lane = tl.arange(0, 4)[None, None, :]
    acc0, acc1, acc2, acc3 = _gemv_accumulators(BLOCK_N, QUADS)  # one per x row
    for qd0 in range(q_begin, q_end, QUADS):
        qd = qd0 + tl.arange(0, QUADS)[None, :, None]
        q_ok = qd < q_end  # constant over a quad's 4 streams: the loads vectorize
        g = qd // 4
        stream = (qd % 4) * 4 + lane  # [1, QUADS, 4]
        unit = words_ptr + rows + g * (16 * G) + stream  # each stream's unit word 0
        a0 = _unit_word(unit, 0, n_ok & q_ok & (g * G < stream_words))
        a1, a2, a3, a4 = a0, a0, a0, a0
        if G > 1:
            a1 = _unit_word(unit, 16, n_ok & q_ok & (g * G + 1 < stream_words))
        if G > 2:
            a2 = _unit_word(unit, 32, n_ok & q_ok & (g * G + 2 < stream_words))
        if G > 3:
            a3 = _unit_word(unit, 48, n_ok & q_ok & (g * G + 3 < stream_words))
        if G > 4:
            a4 = _unit_word(unit, 64, n_ok & q_ok & (g * G + 4 < stream_words))
        col_base = g * GROUP_COLS + stream * D
        t0, xs0, t1, xs1, t2, xs2, t3, xs3 = _word_step_zeros(BLOCK_N, QUADS)
        for i in tl.static_range(CODES // P):
            cur = _pick5(a0, a1, a2, a3, a4, (i * F) // 32)
            nxt = cur
            if (i * F) % 32 + F > 32:  # the field straddles into the next word
                nxt = _pick5(a0, a1, a2, a3, a4, (i * F) // 32 + 1)
            code = _bits_at(cur, nxt, (i * F) % 32, F).to(tl.int32)
            if TWO:  # two fp32 values in one int64 table entry
                v0, v1 = _pair_at(tbl_ptr, code)
            else:
                v0 = tl.load(tbl_ptr + code, eviction_policy="evict_last")
                v1 = v0
            col0 = col_base + 16 * D * P * i
            col1 = col0 + (16 if PAIR else 1)
            t0, xs0 = _field_fma(v0, v1, x_ptr, 0, K, M, col0, col1, TWO, q_ok, t0, xs0)
            if BLOCK_M > 1:
                t1, xs1 = _field_fma(v0, v1, x_ptr, 1, K, M, col0, col1, TWO, q_ok, t1, xs1)
            if BLOCK_M > 2:
                t2, xs2 = _field_fma(v0, v1, x_ptr, 2, K, M, col0, col1, TWO, q_ok, t2, xs2)
                t3, xs3 = _field_fma(v0, v1, x_ptr, 3, K, M, col0, col1, TWO, q_ok, t3, xs3)
        acc0 += tl.sum(t0, axis=2)
        if BLOCK_M > 1:
            acc1 += tl.sum(t1, axis=2)
        if BLOCK_M > 2:
            acc2 += tl.sum(t2, axis=2)
            acc3 += tl.sum(t3, axis=2)
    # the row scale is linear: each K slice's partial takes it before the split-K reduction adds bias
    scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    _gemv_epilogue(acc0 * scale, acc1 * scale, acc2 * scale, acc3 * scale, offs_n, pid_k, M, N, b_ptr, y_ptr,
                   ws_ptr, HAS_BIAS, SPLIT_K, BLOCK_M)


@triton.jit
def _pick5(a0, a1, a2, a3, a4, q: tl.constexpr):
    """The q-th of five values (q a compile-time index)."""
    if q == 4:
        return a4
    else:
        return _pick(a0, a1, a2, a3, q)


@triton.jit
def _unit_word(unit, OFFSET: tl.constexpr, ok):
    """Word OFFSET (compile-time) past each stream's unit word 0, as uint32 (0 where not ok)."""
    return tl.load(unit + OFFSET, mask=ok, other=0, eviction_policy="evict_first").to(tl.uint32, bitcast=True)


@triton.jit
def _put(a0, a1, a2, a3, q: tl.constexpr, v):
    """(a0, a1, a2, a3) with the q-th replaced by v (q a compile-time index)."""
    if q == 0:
        return v, a1, a2, a3
    elif q == 1:
        return a0, v, a2, a3
    elif q == 2:
        return a0, a1, v, a3
    else:
        return a0, a1, a2, v


@triton.jit
def _state_at(a0, a1, a2, a3, P: tl.constexpr):
    """The 16-bit window at bit P (compile-time) of the aligned words a0 a1 a2 a3 (MSB first)."""
    cur = _pick(a0, a1, a2, a3, P // 32)
    if P % 32 <= 16:
        return (cur >> (16 - P % 32)) & 0xFFFF
    else:
        return ((cur << (P % 32 - 16)) | (_pick(a0, a1, a2, a3, P // 32 + 1) >> (48 - P % 32))) & 0xFFFF


@triton.jit
def _tcq_part_mac(acc, x_ptr, x_rows, m_ok, codes_ptr, tbl_ptr, offs_n, k_begin, k_end, col0, KP, N,
                  S: tl.constexpr, Q: tl.constexpr, GEMV: tl.constexpr, DOT_FP32: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """acc += x[:, k_begin:k_end] @ W.T of one TCQ code tensor [N/16, KP/16, 4 S] (its columns start at
    col0; k_begin, k_end multiples of 16): per step the GEMV's FMAs into [BLOCK_M, BLOCK_N, BLOCK_K/16]
    or one tl.dot over the BLOCK_K/16 tiles of the K step.
    One thread decodes a row's 8 steps of a 16 x 16 tile (16 weights): they sit in 8 S + 16 - S
    consecutive bits of the tile's sequence from bit 8 r S (r: the row in its tile), so the row's
    sequence words are read once, shifted to a byte-aligned start (when S % 4 != 0), and every
    step's 16-bit state is then cut out with compile-time shifts. tbl_ptr: the signed table as int64
    (a step's two fp32 weights in one load)."""
    SEQ: tl.constexpr = 4 * S
    ALIGNED: tl.constexpr = S % 4 == 0  # every row starts at a word boundary
    NA: tl.constexpr = (7 * S + 16 + 31) // 32  # aligned words a row's 8 windows span (<= 4)
    KT: tl.constexpr = BLOCK_K // 16
    n_ok = (offs_n < N)[:, None]
    start = (offs_n % 16)[:, None] * (8 * S)  # bit of the row's first step in its tile's sequence
    o = (start % 32).to(tl.uint32)
    seq_row = codes_ptr + (offs_n // 16).to(tl.int64)[:, None] * (KP // 16) * SEQ
    first_word = start // 32
    for k0 in range(k_begin, k_end, BLOCK_K):
        kt = (k0 - col0) // 16 + tl.arange(0, KT)  # tile columns of this code tensor
        ok = n_ok & (kt < (k_end - col0) // 16)[None, :]
        seq = seq_row + kt[None, :] * SEQ
        raw = tl.load(seq + first_word, mask=ok, other=0, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
        a0, a1, a2, a3 = raw, raw, raw, raw  # aligned words: a_q = bits [32 q, 32 q + 32) from the row's start
        for q in tl.static_range(1, NA if ALIGNED else NA + 1):
            nxt = tl.load(seq + (first_word + q) % SEQ, mask=ok, other=0,  # tail-biting
                          eviction_policy="evict_first").to(tl.uint32, bitcast=True)
            if ALIGNED:
                a0, a1, a2, a3 = _put(a0, a1, a2, a3, q, nxt)
            else:
                a0, a1, a2, a3 = _put(a0, a1, a2, a3, q - 1, _window(raw, nxt, o))
            raw = nxt
        x_step = x_ptr + x_rows + (k0 + 16 * tl.arange(0, KT))[None, :]
        x_ok = m_ok & (kt < (k_end - col0) // 16)[None, :]
        for i in tl.static_range(8):
            state = _state_at(a0, a1, a2, a3, i * S)
            if Q == 0:  # the computed 1mad code
                w_even, w_odd = _mad_pair(state)
            else:
                idx = ((state * (state + 1)) >> (15 - Q)) & ((2 << Q) - 1)
                w_even, w_odd = _pair_at(tbl_ptr, idx.to(tl.int32))
            acc = _fma_or_dot(acc, tl.load(x_step + 2 * i, mask=x_ok, other=0.0), w_even, GEMV, DOT_FP32)
            acc = _fma_or_dot(acc, tl.load(x_step + 2 * i + 1, mask=x_ok, other=0.0), w_odd, GEMV, DOT_FP32)
    return acc


@triton.jit
def _tcq_linear_kernel(x_ptr, c_ptr, t_ptr, c2_ptr, t2_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, KH,
                       S: tl.constexpr, Q: tl.constexpr, S2: tl.constexpr, Q2: tl.constexpr, HALF: tl.constexpr,
                       GEMV: tl.constexpr, DOT_FP32: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """TCQ / half-TCQ, both kinds: columns [0, KH) from (c, t, S, Q); with HALF, columns [KH, K) from
    (c2, t2, S2, Q2), decoded step by step from whole sequence words (_tcq_part_mac)."""
    pid_m, pid_n, pid_k, offs_m, offs_n = _tiles(GEMV, BLOCK_M, BLOCK_N)
    x_rows = offs_m[:, None].to(tl.int64) * K
    m_ok = (offs_m < M)[:, None]
    k_begin, k_end = _k_slice(pid_k, K, SPLIT_K, BLOCK_K)
    acc = _acc_init(GEMV, BLOCK_M, BLOCK_N, BLOCK_K // 16)
    acc = _tcq_part_mac(acc, x_ptr, x_rows, m_ok, c_ptr, t_ptr, offs_n, k_begin, tl.minimum(k_end, KH), 0, KH, N,
                        S, Q, GEMV, DOT_FP32, BLOCK_K)
    if HALF:  # a slice across K/2 continues at KH (a multiple of 16) with the second code
        acc = _tcq_part_mac(acc, x_ptr, x_rows, m_ok, c2_ptr, t2_ptr, offs_n, tl.maximum(k_begin, KH), k_end, KH,
                            K - KH, N, S2, Q2, GEMV, DOT_FP32, BLOCK_K)
    _scaled_epilogue(_acc_total(acc, GEMV), offs_m, offs_n, pid_k, M, N, s_ptr, b_ptr, y_ptr, ws_ptr, HAS_BIAS,
                     SPLIT_K)


@triton.jit
def _scaled_epilogue(acc, offs_m, offs_n, pid_k, M, N, s_ptr, b_ptr, y_ptr, ws_ptr, HAS_BIAS: tl.constexpr,
                     SPLIT_K: tl.constexpr):
    # the row scale is linear, so each K slice's partial sum takes it before the reduction adds bias
    scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    _epilogue(acc * scale[None, :], offs_m, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS, SPLIT_K)


# -- kernels --------------------------------------------------------------------------------------
@triton.jit
def _store_scaled(out_ptr, w, s_ptr, offs_n, k, k_lim, N, K):
    scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    _store_tile(out_ptr, w * scale[:, None], offs_n, k, k_lim, N, K)


@triton.jit
def _codebook_dequant_kernel(words_ptr, tbl_ptr, s_ptr, out_ptr, N, K, ROW_WORDS, BITS: tl.constexpr,
                             D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _codebook_tile(words_ptr, tbl_ptr, offs_n, k0, N, K, ROW_WORDS, BITS, D, BLOCK_K)
    _store_scaled(out_ptr, w, s_ptr, offs_n, k0 + tl.arange(0, BLOCK_K), K, N, K)


@triton.jit
def _tcq_dequant_kernel(c_ptr, t_ptr, c2_ptr, t2_ptr, s_ptr, out_ptr, N, K, KH, S: tl.constexpr,
                        Q: tl.constexpr, S2: tl.constexpr, Q2: tl.constexpr, HALF: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(1) * BLOCK_K
    k_end = tl.minimum(k_begin + BLOCK_K, K)
    lo_end = tl.minimum(k_end, KH)
    for k0 in range(k_begin, lo_end, BLOCK_K):  # at most once; the block may straddle KH
        w = _tcq_tile(c_ptr, t_ptr, offs_n, k0, lo_end, N, KH, S, Q, BLOCK_K)
        _store_scaled(out_ptr, w, s_ptr, offs_n, k0 + tl.arange(0, BLOCK_K), lo_end, N, K)
    if HALF:
        for k0 in range(tl.maximum(k_begin, KH), k_end, BLOCK_K):
            w = _tcq_tile(c2_ptr, t2_ptr, offs_n, k0 - KH, k_end - KH, N, K - KH, S2, Q2, BLOCK_K)
            _store_scaled(out_ptr, w, s_ptr, offs_n, k0 + tl.arange(0, BLOCK_K), k_end, N, K)


# -- input checks ---------------------------------------------------------------------------------
def _check_scales(op, row_scales, n):
    if row_scales.dtype != torch.float16 or tuple(row_scales.shape) != (n,):
        raise ValueError(f"{op} (triton): row_scales must be fp16 [{n}], got {row_scales.dtype} "
                         f"{tuple(row_scales.shape)}")


def _codebook_shapes(op, codes, code_bits, table, row_scales, in_features):
    """(N, d, row words) of codebook codes, with clear errors for what the kernels cannot read."""
    if not 1 <= code_bits <= 12:
        raise ValueError(f"{op} (triton): code_bits must be 1..12, got {code_bits}")
    if table.dtype != torch.float32 or table.dim() != 2 or table.shape[0] != 2 ** code_bits \
            or table.shape[1] not in (1, 2):
        raise ValueError(f"{op} (triton): table must be fp32 [2^code_bits = {2 ** code_bits}, 1 or 2] (the "
                         f"format's codebook), got {table.dtype} {tuple(table.shape)}")
    d = table.shape[1]
    if in_features <= 0 or in_features % d:
        raise ValueError(f"{op} (triton): in_features {in_features} must be a positive multiple of {d} "
                         "(weights per code)")
    per_stream = -(-(in_features // d) // STREAMS)
    words = STREAMS * -(-per_stream * code_bits // 32)
    if codes.dtype != torch.int32 or codes.dim() != 2 or codes.shape[1] != words:
        raise ValueError(f"{op} (triton): codes must be int32 [N, {words}] ({in_features // d} {code_bits}-bit codes "
                         f"per row in 16 streams, layouts.palette_packed.pack_streams), got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    _check_scales(op, row_scales, codes.shape[0])
    return codes.shape[0], d, words


def _tcq_part(op, codes, table, table_bits, shift_bits):
    """K of one TCQ code tensor, with clear errors."""
    if not 3 <= shift_bits <= 10:
        raise ValueError(f"{op} (triton): shift_bits must be 3..10 (tcq1.5 .. tcq5), got {shift_bits}")
    if not 0 <= table_bits <= 15 or table.dtype != torch.float32 \
            or tuple(table.shape) != tcq.kernel_table_shape(table_bits):
        raise ValueError(f"{op} (triton): table must be the fp32 signed table [2^(table_bits+1), 2] "
                         f"(formats.tcq.tcq_kernel_table; table_bits 0: the 1mad code, [0, 2]), got "
                         f"{table.dtype} {tuple(table.shape)} for table_bits={table_bits}")
    if codes.dtype != torch.int32 or codes.dim() != 3 or codes.shape[2] != 4 * shift_bits:
        raise ValueError(f"{op} (triton): codes must be int32 [N/16, K/16, {4 * shift_bits}], got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    return codes.shape[1] * TILE


# -- launchers ------------------------------------------------------------------------------------
def codebook_linear(x, codes, code_bits, table, row_scales, bias=None, *, config=None):
    """y = x @ W'.T + bias for nuq/vq codes (the op torch_lowbit::codebook_linear), x already rotated;
    output in x's dtype, any leading dims. config: force a launch config (tests, benchmarks)."""
    op = "codebook_linear"
    check_device(op, "x", x, {"codes": codes, "table": table, "row_scales": row_scales, "bias": bias})
    n, d, words = _codebook_shapes(op, codes, code_bits, table, row_scales, x.shape[-1])
    check_x(op, x, x.shape[-1], n, bias)
    codes, table, row_scales = codes.contiguous(), table.contiguous(), row_scales.contiguous()
    pair = d == 1 and code_bits <= PAIR_MAX_BITS
    if pair:
        entries = derived(table, "pair_table", pair_table)
    else:
        entries = table.view(torch.int64) if d == 2 else table
    unit_words = code_bits // math.gcd(code_bits, 32)
    launch = KernelLaunch(_codebook_linear_kernel, (codes, entries, row_scales),
                          dict(BITS=code_bits, D=d, G=unit_words, PAIR=pair), (words,),
                          k_unit=STREAMS * (32 * unit_words // code_bits) * d)
    lookups = (32 * unit_words // code_bits) // (2 if pair else 1)  # table lookups per unit
    # the 16-byte-load GEMV: units of up to 5 words and 16 lookups (vq1.5 and vq2.5, 32 pair lookups a
    # unit, spill 90-280 bytes there at every tile on sm_90: they keep the other GEMV)
    if unit_words <= 5 and lookups <= 16:
        cols_per_quad = 4 * (32 * unit_words // code_bits) * d
        tiles = quad_tiles(cols_per_quad)
        gemv = KernelLaunch(_codebook_gemv_kernel, (codes, entries, row_scales),
                            dict(BITS=code_bits, D=d, G=unit_words, PAIR=pair), (words,), kind_flags=False, tiles=tiles,
                            default=tiles[0], k_unit=cols_per_quad)
    else:
        gemv = replace(launch, tiles=_CODEBOOK_GEMV_TILES, default=(64, 256, 4))
    launches = {"gemv": gemv, "dot": replace(launch, tiles=WORD_DOT_TILES, default=(64, 256, 4, 2))}
    return linear_launch(op, x, n, launches, bias, f"b{code_bits}_d{d}", config,
                         lambda dtype: codebook_dequantize(codes, code_bits, table, row_scales, x.shape[-1], dtype=dtype))


def codebook_dequantize(codes, code_bits, table, row_scales, in_features, *, dtype=torch.float32):
    """W' [N, in_features] = row_scale * table[code] in `dtype` (the op torch_lowbit::codebook_dequantize:
    fp32)."""
    op = "codebook_dequantize"
    check_device(op, "codes", codes, {"table": table, "row_scales": row_scales})
    n, d, words = _codebook_shapes(op, codes, code_bits, table, row_scales, in_features)
    return dequant_launch(_codebook_dequant_kernel, n, in_features,
                          (codes.contiguous(), table.contiguous(), row_scales.contiguous()),
                          dict(ROW_WORDS=words, BITS=code_bits, D=d), codes.device, dtype)


def _tcq_parts(op, parts, row_scales, ref_name, ref, extra):
    """(N, K, KH, kernel args, constexprs, key) of one or two TCQ parts (codes, table, Q, s)."""
    suffixes = ("",) if len(parts) == 1 else ("_lo", "_hi")
    check_device(op, ref_name, ref, {f"{name}{sfx}": t for sfx, p in zip(suffixes, parts)
                                      for name, t in (("codes", p[0]), ("table", p[1]))} | extra)
    widths = [_tcq_part(op, *p) for p in parts]
    n = parts[0][0].shape[0] * TILE
    if any(p[0].shape[0] * TILE != n for p in parts):
        raise ValueError(f"{op} (triton): both halves' codes must cover the same {n} rows, got "
                         f"{[tuple(p[0].shape) for p in parts]}")
    _check_scales(op, row_scales, n)
    (c, t, q, s), (c2, t2, q2, s2) = parts[0], parts[-1]
    args = (c.contiguous(), t.contiguous(), c2.contiguous(), t2.contiguous())
    consts = dict(S=s, Q=q, S2=s2, Q2=q2, HALF=len(parts) == 2)
    key = "_".join(f"s{p[3]}q{p[2]}" for p in parts)
    return n, sum(widths), widths[0], args, consts, key


def _tcq_linear(op, x, parts, row_scales, bias, config):
    n, k, kh, args, consts, key = _tcq_parts(op, parts, row_scales, "x", x, {"row_scales": row_scales, "bias": bias})
    check_x(op, x, k, n, bias)
    row_scales = row_scales.contiguous()
    c, t, c2, t2 = args
    launch = KernelLaunch(_tcq_linear_kernel, (c, t.view(torch.int64), c2, t2.view(torch.int64), row_scales), consts,
                          (kh,))
    launches = {"gemv": replace(launch, tiles=_TCQ_GEMV_TILES, default=(128, 128, 4), k_unit=TILE),
                "dot": replace(launch, tiles=WORD_DOT_TILES, default=(64, 256, 4, 2), k_unit=16 * TILE)}
    return linear_launch(op, x, n, launches, bias, key, config, lambda dtype: _tcq_dequantize(op, parts, row_scales, dtype))


def tcq_linear(x, codes, table, table_bits, shift_bits, row_scales, bias=None, *, config=None):
    """y = x @ W'.T + bias for TCQ codes [N/16, K/16, 4 s] (the op torch_lowbit::tcq_linear)."""
    return _tcq_linear("tcq_linear", x, [(codes, table, table_bits, shift_bits)], row_scales, bias, config)


def tcq_half_linear(x, codes_lo, table_lo, table_bits_lo, shift_bits_lo, codes_hi, table_hi, table_bits_hi,
                    shift_bits_hi, row_scales, bias=None, *, config=None):
    """half-TCQ in one launch: columns [0, K_lo) from the _lo code, the rest from the _hi code (the op
    torch_lowbit::tcq_half_linear)."""
    return _tcq_linear("tcq_half_linear", x, [(codes_lo, table_lo, table_bits_lo, shift_bits_lo),
                                              (codes_hi, table_hi, table_bits_hi, shift_bits_hi)],
                       row_scales, bias, config)


def _tcq_dequantize(op, parts, row_scales, dtype=torch.float32):
    codes = parts[0][0]
    n, k, kh, args, consts, _ = _tcq_parts(op, parts, row_scales, "codes", codes, {"row_scales": row_scales})
    return dequant_launch(_tcq_dequant_kernel, n, k, (*args, row_scales.contiguous()), dict(KH=kh, **consts),
                          codes.device, dtype)


def tcq_dequantize(codes, table, table_bits, shift_bits, row_scales):
    """fp32 W' [N, K] (the op torch_lowbit::tcq_dequantize)."""
    return _tcq_dequantize("tcq_dequantize", [(codes, table, table_bits, shift_bits)], row_scales)


def tcq_half_dequantize(codes_lo, table_lo, table_bits_lo, shift_bits_lo, codes_hi, table_hi, table_bits_hi,
                        shift_bits_hi, row_scales):
    """fp32 W' [N, K_lo + K_hi] of half-TCQ codes, one launch."""
    return _tcq_dequantize("tcq_half_dequantize", [(codes_lo, table_lo, table_bits_lo, shift_bits_lo),
                                                   (codes_hi, table_hi, table_bits_hi, shift_bits_hi)], row_scales)
