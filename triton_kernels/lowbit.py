"""Fused decode-matmul for the sub-4-bit group formats off the CPU: y = x @ W.T + bias.

Both layouts store a row's b-bit codes as one MSB-first bit stream (layouts.palette_packed.pack_stream:
code j at bits [j b, j b + b) of the row, int32 words, the row padded to a word):
- stream_rowmajor (int1_g*, int2_g*, int2_sym_g*, int3_g*, q8_0; layouts/stream_rowmajor.py): W[n, k] =
  lut[code] * scale[n, k // group] (+ min), fp16 scales / mins [N, K / group], the format's fp32
  table of 2^b code values.
- gcb_rowmajor (gcb2, gcb3; layouts/gcb.py): W[n, k] = codebooks[c][code] * (s * d) with the
  sub-group byte c << 4 | s of (n, k // 32) as uint8 [N, K / 32], d the fp16 superblock scale
  [N, K / superblock] and the layer's int8 codebooks [C, 2^b] (read as an fp32 copy, <= 512 B,
  gathered from global memory, evict_last so L1 keeps it).
`_lowbit_linear_kernel` serves both layouts and both kernel kinds from whole words (a unit of G
words = 32 G / b consecutive codes at compile-time shifts, one group scale — gcb: one sub-group
byte and superblock scale — per unit). The per-element decoders `_lowbit_tile` / `_gcb_tile` drive
the dequantize kernel (matmul._group_dequant_kernel: the large-M dequantize + cuBLAS route, tests).
Kernel kinds by M, configs, split-K and the launcher are matmul.py's.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from torch_lowbit.core.packing import GCB_CODE_BITS, STREAM_CODE_BITS
from torch_lowbit.core.packing import GCB_SUBGROUP as SUBGROUP  # weights per gcb sub-group byte

from .matmul import (WORD_DOT_TILES, KernelLaunch, _acc_init, _acc_total, _bits_at, _epilogue, _fma_or_dot,
                     _gemv_accumulators, _gemv_epilogue, _group_dequant_kernel, _k_slice, _lookup, _tiles,
                     _unit_words, _window, _word_fma_rows, _word_step_zeros,
                     check_device, check_x, dequant_launch, derived, linear_launch, quad_tiles, table_form)

_SUBGROUP = tl.constexpr(SUBGROUP)  # jit code reads only constexpr globals (the interpreter does not check)
# (BLOCK_N, BLOCK_K, num_warps) of the lowbit GEMV: the x a thread loads serves the rows it holds
_GEMV_TILES = ((32, 256, 4), (64, 256, 4), (32, 512, 4), (64, 512, 8), (128, 256, 8))



# -- decoders --------------------------------------------------------------------------------------
@triton.jit
def _apply_groups(w, s_ptr, mn_ptr, offs_n, k, N, K, GROUP: tl.constexpr, HAS_MIN: tl.constexpr):
    """w * scale (+ min) of each weight's group: fp16 [N, K / GROUP] scales (and mins)."""
    mask = (offs_n[:, None] < N) & (k[None, :] < K)
    g_off = offs_n[:, None].to(tl.int64) * (K // GROUP) + (k // GROUP)[None, :]
    w = w * tl.load(s_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_MIN:
        w = w + tl.load(mn_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    return w


@triton.jit
def _row_codes(words_ptr, offs_n, k, N, K, ROW_WORDS, BITS: tl.constexpr):
    """int32 codes [BLOCK_N, len(k)] of rows offs_n, columns k, from one MSB-first stream per row."""
    mask = (offs_n[:, None] < N) & (k[None, :] < K)
    pos = k * BITS
    w = pos // 32
    o = (pos % 32).to(tl.uint32)[None, :]
    row = words_ptr + offs_n[:, None].to(tl.int64) * ROW_WORDS
    first = tl.load(row + w[None, :], mask=mask, other=0, eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    if 32 % BITS == 0:  # 1, 2 (4) bits: a code never straddles two words
        codes = (first >> (32 - BITS - o)) & ((1 << BITS) - 1)
    else:  # read the next word only where the code straddles it
        straddles = (o + BITS > 32) & mask
        second = tl.load(row + (w + 1)[None, :], mask=straddles, other=0,
                         eviction_policy="evict_first").to(tl.uint32, bitcast=True)
        codes = _window(first, second, o) >> (32 - BITS)
    return codes.to(tl.int32)


@triton.jit
def _lowbit_tile(words_ptr, s_ptr, mn_ptr, lut, offs_n, k, N, K, ROW_WORDS, BITS: tl.constexpr,
                 GROUP: tl.constexpr, HAS_MIN: tl.constexpr):
    """fp32 weights [BLOCK_N, len(k)]: lut[code] * group scale (+ group min)."""
    codes = _row_codes(words_ptr, offs_n, k, N, K, ROW_WORDS, BITS)
    return _apply_groups(_lookup(lut, codes), s_ptr, mn_ptr, offs_n, k, N, K, GROUP, HAS_MIN)


@triton.jit
def _gcb_tile(words_ptr, sub_ptr, d_ptr, cb_ptr, offs_n, k, N, K, ROW_WORDS, BITS: tl.constexpr,
              SUPERBLOCK: tl.constexpr, HAS_MIN: tl.constexpr):
    """fp32 weights [BLOCK_N, len(k)]: codebooks[c][code] * (s * d), in the reference's order
    (matmul's group-kernel decoder signature: GROUP is the superblock; no mins)."""
    mask = (offs_n[:, None] < N) & (k[None, :] < K)
    codes = _row_codes(words_ptr, offs_n, k, N, K, ROW_WORDS, BITS)
    rows = offs_n[:, None].to(tl.int64)
    sub = tl.load(sub_ptr + rows * (K // _SUBGROUP) + (k // _SUBGROUP)[None, :], mask=mask, other=0).to(tl.int32)
    d = tl.load(d_ptr + rows * (K // SUPERBLOCK) + (k // SUPERBLOCK)[None, :], mask=mask, other=0.0)
    value = tl.load(cb_ptr + (sub >> 4) * (1 << BITS) + codes, eviction_policy="evict_last").to(tl.float32)
    return value * ((sub & 15).to(tl.float32) * d.to(tl.float32))


@triton.jit
def _code_float(cur, nxt, OFF: tl.constexpr, BITS: tl.constexpr):
    """The BITS-bit code at bit OFF (compile-time, MSB first) of the word pair cur, nxt as the fp32
    1 + c / 2^BITS: its bits moved straight into the top of the mantissa of 1.0 (no int->float)."""
    if OFF + BITS <= 32:
        top = cur << OFF
    else:
        top = (cur << OFF) | (nxt >> (32 - OFF))
    return (((top >> 9) & (((1 << BITS) - 1) << (23 - BITS))) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _lowbit_linear_kernel(x_ptr, words_ptr, s_ptr, mn_ptr, lut_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, ROW_WORDS,
                          BITS: tl.constexpr, G: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
                          AFFINE: tl.constexpr, LUT_A: tl.constexpr, LUT_B: tl.constexpr, CODEBOOKS: tl.constexpr,
                          GEMV: tl.constexpr,
                          DOT_FP32: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """stream_rowmajor and (CODEBOOKS) gcb_rowmajor, both kinds, from whole stream words: a unit is the
    G = BITS / gcd(BITS, 32) words holding C = 32 G / BITS consecutive codes (columns), inside one
    group or gcb sub-group (C <= 32), so every code sits at a compile-time shift and the unit's scale
    (and min) is read once per unit and row.
    Values: AFFINE tables (lut[c] = LUT_A c + LUT_B: every int* grid; fp16/bf16 activations) as
    _code_float's 1 + c / 2^BITS; others gathered from the <= 16-value table (one L1 line).
    CODEBOOKS: s_ptr holds gcb's sub-group bytes c << 4 | s ([N, K / 32]), mn_ptr the superblock
    scales d ([N, K / GROUP]), lut_ptr the fp32 copy of the int8 codebooks [C, 2^BITS] (<= 512 B):
    the unit's scale is s d, its codes index codebook c.
    GEMV: t = sum x * value per unit, then sum x lut[c] = A 2^BITS (t - sum x) + B sum x, scaled
    once per unit; tl.dot: value * a + b with per-unit a, b (one FMA per weight), one tl.dot per
    code position i of the units (x columns unit + i)."""
    C: tl.constexpr = 32 * G // BITS
    U: tl.constexpr = BLOCK_K // C
    ONE: tl.constexpr = 1 << BITS
    pid_m, pid_n, pid_k, offs_m, offs_n = _tiles(GEMV, BLOCK_M, BLOCK_N)
    k_begin, k_end = _k_slice(pid_k, K, SPLIT_K, BLOCK_K)
    u = tl.arange(0, U)
    n_ok = (offs_n < N)[:, None]
    m_ok = (offs_m < M)[:, None]
    row_words = words_ptr + offs_n[:, None].to(tl.int64) * ROW_WORDS
    group_rows = offs_n[:, None].to(tl.int64) * (K // GROUP)
    sub_rows = offs_n[:, None].to(tl.int64) * (K // _SUBGROUP)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * K
    acc = _acc_init(GEMV, BLOCK_M, BLOCK_N, U)
    for k0 in range(k_begin, k_end, BLOCK_K):
        col = k0 + u * C  # each unit's first column
        u_ok = (col < k_end)[None, :]
        word0 = (k0 // C + u) * G
        unit_ptr = row_words + word0[None, :]
        g_off = group_rows + (col // GROUP)[None, :]
        low = tl.zeros((BLOCK_N, U), dtype=tl.float32)  # the min, or 0
        if CODEBOOKS:
            sub = tl.load(s_ptr + sub_rows + (col // _SUBGROUP)[None, :], mask=n_ok & u_ok, other=0).to(tl.int32)
            d = tl.load(mn_ptr + g_off, mask=n_ok & u_ok, other=0.0).to(tl.float32)
            scale = (sub & 15).to(tl.float32) * d
            book = (sub >> 4) << BITS  # the unit's codebook: its first entry in the flat table
        else:
            scale = tl.load(s_ptr + g_off, mask=n_ok & u_ok, other=0.0).to(tl.float32)
            book = 0
            if HAS_MIN:
                low = tl.load(mn_ptr + g_off, mask=n_ok & u_ok, other=0.0).to(tl.float32)
        cur, nxt = 0, 0  # the unit's words, loaded at its first field
        if GEMV:
            t = tl.zeros((BLOCK_M, BLOCK_N, U), dtype=tl.float32)
            x_sum = tl.zeros((BLOCK_M, U), dtype=tl.float32)
        else:  # value -> weight, scale, min and the affine form folded (AFFINE: value = 1 + c / 2^BITS)
            a = scale * (ONE * LUT_A if AFFINE else 1.0)
            b = scale * (LUT_B - ONE * LUT_A if AFFINE else 0.0) + low
        for i in tl.static_range(C):
            cur, nxt = _unit_words(unit_ptr, word0, i * BITS, BITS, cur, nxt, 1, G, ROW_WORDS, n_ok)
            if AFFINE:
                f = _code_float(cur, nxt, (i * BITS) % 32, BITS)
            else:
                f = _lookup(lut_ptr, book + _bits_at(cur, nxt, (i * BITS) % 32, BITS).to(tl.int32))
            x = tl.load(x_rows + (col + i)[None, :], mask=m_ok & ((col + i) < k_end)[None, :], other=0.0)
            if GEMV:
                x = x.to(tl.float32)
                x_sum += x
                t += f[None, :, :] * x[:, None, :]
            else:
                acc = _fma_or_dot(acc, x, f * a + b, False, DOT_FP32)
        if GEMV:
            if AFFINE:  # sum x lut[c] = A 2^BITS (t - sum x) + B sum x
                t = (LUT_A * ONE) * t + ((LUT_B - LUT_A * ONE) * x_sum)[:, None, :]
            acc += t * scale[None, :, :]
            if HAS_MIN:
                acc += x_sum[:, None, :] * low[None, :, :]
    _epilogue(_acc_total(acc, GEMV), offs_m, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS, SPLIT_K)


@triton.jit
def _word_total(t, xs, scale, low, ONE: tl.constexpr, AFFINE: tl.constexpr, LUT_A: tl.constexpr,
                LUT_B: tl.constexpr, HAS_MIN: tl.constexpr):
    """[BLOCK_N, QUADS]: each quad's sum of x * weight over its 4 words (in the thread). AFFINE: values
    were 1 + c / 2^BITS, so sum x lut[c] = A 2^BITS t + (B - A 2^BITS) sum x; times each word's scale
    (and min) before the sum."""
    if AFFINE:
        t = (LUT_A * ONE) * t + (LUT_B - LUT_A * ONE) * xs
    total = t * scale
    if HAS_MIN:
        total += xs * low
    return tl.sum(total, axis=2)


@triton.jit
def _word_totals(acc0, acc1, acc2, acc3, t0, xs0, t1, xs1, t2, xs2, t3, xs3, scale, low, ONE: tl.constexpr,
                 AFFINE: tl.constexpr, LUT_A: tl.constexpr, LUT_B: tl.constexpr, HAS_MIN: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """Each of the BLOCK_M (<= 4) x rows' accumulator plus its _word_total of this K step."""
    acc0 += _word_total(t0, xs0, scale, low, ONE, AFFINE, LUT_A, LUT_B, HAS_MIN)
    if BLOCK_M > 1:
        acc1 += _word_total(t1, xs1, scale, low, ONE, AFFINE, LUT_A, LUT_B, HAS_MIN)
    if BLOCK_M > 2:
        acc2 += _word_total(t2, xs2, scale, low, ONE, AFFINE, LUT_A, LUT_B, HAS_MIN)
        acc3 += _word_total(t3, xs3, scale, low, ONE, AFFINE, LUT_A, LUT_B, HAS_MIN)
    return acc0, acc1, acc2, acc3


@triton.jit
def _lowbit_gemv_kernel(x_ptr, words_ptr, s_ptr, mn_ptr, lut_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, ROW_WORDS,
                        GROUP_WORDS, SUB_WORDS, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BITS: tl.constexpr,
                        G: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, AFFINE: tl.constexpr,
                        LUT_A: tl.constexpr, LUT_B: tl.constexpr, CODEBOOKS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMV kind (M <= 4) of _lowbit_linear_kernel's formats whose codes never straddle a word
    (BITS 1, 2, 8: G = 1; C = 32 / BITS codes a word), laid out for the memory system as
    lut4._lut4_gemv_kernel is: a thread owns 4 consecutive words of a row (one 16-byte load),
    consecutive threads the next 4, the warps and repeats the rows; each code position i of the words
    is one [BLOCK_N, QUADS, 4] value tile times x at columns word * C + i, loaded in the words' layout
    (matmul._word_fma); a word's scale (and min, or gcb's sub-group byte and superblock scale) is read per
    word through runtime divisors (GROUP_WORDS, SUB_WORDS words per group and sub-group: a compile-time
    divisor lets Triton give those loads a layout of their own, converted through shared memory).
    Up to 4 x rows share each decoded word. No shared memory or barrier in the K loop (sm_90 cubins)."""
    tl.static_assert(G == 1, "codes straddling words (3 bits) take _lowbit_linear_kernel's GEMV")
    C: tl.constexpr = 32 // BITS
    QUADS: tl.constexpr = BLOCK_K // (4 * C)
    ONE: tl.constexpr = 1 << BITS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < N)[:, None, None]
    # slices end at whole quads or the row's end: ROW_WORDS (= K / C), not K // C, so that where Triton
    # knows it divisible by 16 the mask is constant over a quad and the word loads vectorize
    w_begin, w_end = _k_slice(pid_k, ROW_WORDS, SPLIT_K, 4 * QUADS)  # in words
    rows = offs_n[:, None, None].to(tl.int64)
    quad = tl.arange(0, QUADS)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [1, QUADS, 4]
    acc0, acc1, acc2, acc3 = _gemv_accumulators(BLOCK_N, QUADS)  # one per x row
    for w0 in range(w_begin, w_end, 4 * QUADS):
        w = w0 + quad
        w_ok = w < w_end
        ok = n_ok & w_ok
        words = tl.load(words_ptr + rows * ROW_WORDS + w, mask=ok, other=0,
                        eviction_policy="evict_first").to(tl.uint32, bitcast=True)  # [BLOCK_N, QUADS, 4]
        low = tl.zeros((BLOCK_N, QUADS, 4), dtype=tl.float32)
        if CODEBOOKS:  # s_ptr: sub-group bytes c << 4 | s [N, K / 32]; mn_ptr: superblock scales [N, K / GROUP]
            sub = tl.load(s_ptr + rows * (K // _SUBGROUP) + w // SUB_WORDS, mask=ok, other=0).to(tl.int32)
            d = tl.load(mn_ptr + rows * (K // GROUP) + w // GROUP_WORDS, mask=ok, other=0.0).to(tl.float32)
            scale = (sub & 15).to(tl.float32) * d
            book = (sub >> 4) << BITS
        else:
            g_off = rows * (K // GROUP) + w // GROUP_WORDS
            scale = tl.load(s_ptr + g_off, mask=ok, other=0.0).to(tl.float32)
            book = 0
            if HAS_MIN:
                low = tl.load(mn_ptr + g_off, mask=ok, other=0.0).to(tl.float32)
        t0, xs0, t1, xs1, t2, xs2, t3, xs3 = _word_step_zeros(BLOCK_N, QUADS)
        for i in tl.static_range(C):
            if AFFINE:
                f = _code_float(words, words, i * BITS, BITS)
            else:
                f = _lookup(lut_ptr, book + _bits_at(words, words, i * BITS, BITS).to(tl.int32))
            t0, xs0, t1, xs1, t2, xs2, t3, xs3 = _word_fma_rows(f, x_ptr, K, M, w * C + i, w_ok, t0, xs0, t1, xs1,
                                                                t2, xs2, t3, xs3, BLOCK_M)
        acc0, acc1, acc2, acc3 = _word_totals(acc0, acc1, acc2, acc3, t0, xs0, t1, xs1, t2, xs2, t3, xs3, scale, low,
                                              ONE, AFFINE, LUT_A, LUT_B, HAS_MIN, BLOCK_M)
    _gemv_epilogue(acc0, acc1, acc2, acc3, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS, SPLIT_K, BLOCK_M)

# -- input checks ----------------------------------------------------------------------------------
def stream_words(in_features: int, code_bits: int) -> int:
    """int32 words per row of one MSB-first code stream (layouts.palette_packed.pack_stream)."""
    return -(-in_features * code_bits // 32)


def _codes_check(op, codes, code_bits, n, k):
    words = stream_words(k, code_bits)
    if codes.dtype != torch.int32 or tuple(codes.shape) != (n, words):
        raise ValueError(f"{op} (triton): codes must be int32 [{n}, {words}] (one {code_bits}-bit MSB-first stream "
                         f"per row, layouts.palette_packed.pack_stream), got {codes.dtype} {tuple(codes.shape)}")
    return words


def _lowbit_shapes(op, codes, code_bits, scales, mins, lut, group_size):
    """(N, K, row words) of stream_rowmajor buffers, with clear errors for what the kernels cannot read."""
    if code_bits not in STREAM_CODE_BITS:
        raise ValueError(f"{op} (triton): code_bits must be one of {STREAM_CODE_BITS}, got {code_bits}")
    if scales.dtype != torch.float16 or scales.dim() != 2:
        raise ValueError(f"{op} (triton): scales must be 2-D fp16 [N, K/group], got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if group_size <= 0 or group_size % 32:
        raise ValueError(f"{op} (triton): group size {group_size} must be a positive multiple of 32")
    n, k = scales.shape[0], scales.shape[1] * group_size
    if mins is not None and (mins.dtype != torch.float16 or mins.shape != scales.shape):
        raise ValueError(f"{op} (triton): mins must be fp16 of the scales' shape {tuple(scales.shape)}")
    if lut.dtype != torch.float32 or lut.numel() != 2 ** code_bits:
        raise ValueError(f"{op} (triton): lut must be {2 ** code_bits} fp32 values (the format's code_values()), "
                         f"got {lut.numel()} {lut.dtype}")
    return n, k, _codes_check(op, codes, code_bits, n, k)


def _gcb_shapes(op, codes, code_bits, sub_groups, super_scales, codebooks):
    """(N, K, row words, superblock) of gcb_rowmajor buffers, with clear errors."""
    if sub_groups.dtype != torch.uint8 or sub_groups.dim() != 2:
        raise ValueError(f"{op} (triton): sub_groups must be 2-D uint8 [N, K/32], got {sub_groups.dtype} "
                         f"{tuple(sub_groups.shape)}")
    n, k = sub_groups.shape[0], sub_groups.shape[1] * SUBGROUP
    if super_scales.dtype != torch.float16 or super_scales.dim() != 2 or super_scales.shape[0] != n \
            or super_scales.shape[1] == 0 or k % super_scales.shape[1] or (k // super_scales.shape[1]) % SUBGROUP:
        raise ValueError(f"{op} (triton): super_scales must be fp16 [{n}, K/superblock] with the superblock a "
                         f"multiple of 32 dividing K={k}, got {super_scales.dtype} {tuple(super_scales.shape)}")
    if code_bits not in GCB_CODE_BITS or codebooks.dtype != torch.int8 or codebooks.dim() != 2 \
            or codebooks.shape[1] != 2 ** code_bits or not 1 <= codebooks.shape[0] <= 16:
        raise ValueError(f"{op} (triton): codebooks must be int8 [1..16, 2^code_bits] with code_bits one of "
                         f"{GCB_CODE_BITS}, got {codebooks.dtype} {tuple(codebooks.shape)} for code_bits={code_bits}")
    return n, k, _codes_check(op, codes, code_bits, n, k), k // super_scales.shape[1]


# -- launchers -------------------------------------------------------------------------------------
def _lowbit_weights(codes, scales, mins, lut):
    return (codes.contiguous(), scales.contiguous(), mins.contiguous() if mins is not None else scales, lut.contiguous())


def _gcb_weights(codes, sub_groups, super_scales, codebooks):
    return codes.contiguous(), sub_groups.contiguous(), super_scales.contiguous(), codebooks.contiguous()


def _lowbit_consts(code_bits, group_size, mins):
    return dict(DECODE=_lowbit_tile, BITS=code_bits, GROUP=group_size, HAS_MIN=mins is not None)


def _gcb_consts(code_bits, superblock):
    return dict(DECODE=_gcb_tile, BITS=code_bits, GROUP=superblock, HAS_MIN=False)


# gcb's tl.dot tiles: one stage, as with two the pipeliner stages every codebook gather through shared
# memory (an async copy and a read back per weight, 64-130 KiB; sm_90 cubins: 14-15 -> 12 instr/weight)
_GCB_DOT_TILES = tuple(dict.fromkeys(tile[:4] + (1,) for tile in WORD_DOT_TILES))


def _word_launches(weights, code_bits, words, **consts) -> dict:
    """Both kinds of _lowbit_linear_kernel: its own tiles, BLOCK_K in whole units (tl.dot: 16 a step)."""
    unit_words = code_bits // math.gcd(code_bits, 32)
    codes_per_unit = 32 * unit_words // code_bits
    launch = KernelLaunch(_lowbit_linear_kernel, weights, dict(BITS=code_bits, G=unit_words, **consts), (words,))
    dot = dict(tiles=_GCB_DOT_TILES, default=(128, 256, 8, 1)) if consts["CODEBOOKS"] else \
        dict(tiles=WORD_DOT_TILES, default=(64, 256, 8, 2))
    if unit_words == 1:  # codes never straddle words: the 16-byte-load GEMV; the runtime divisors (words
        # per group, per gcb sub-group) keep Triton from giving the scale loads a layout of their own
        tiles = quad_tiles(4 * codes_per_unit)
        gemv = KernelLaunch(_lowbit_gemv_kernel, weights, dict(BITS=code_bits, G=1, **consts),
                            (words, consts["GROUP"] // codes_per_unit, max(1, SUBGROUP // codes_per_unit)),
                            kind_flags=False, tiles=tiles, default=tiles[0], k_unit=4 * codes_per_unit)
    else:
        gemv = replace(launch, tiles=_GEMV_TILES, default=(64, 256, 4), k_unit=codes_per_unit)
    return {"gemv": gemv, "dot": replace(launch, k_unit=16 * codes_per_unit, **dot)}


def lowbit_linear(x, codes, code_bits, scales, mins, lut, group_size, bias=None, *, config=None):
    """y = x @ W.T + bias for stream_rowmajor buffers (the op torch_lowbit::lowbit_linear), output in
    x's dtype, any leading dims of x. config: force a launch config (tests, benchmarks)."""
    op = "lowbit_linear"
    check_device(op, "x", x, {"codes": codes, "scales": scales, "mins": mins, "lut": lut, "bias": bias})
    n, k, words = _lowbit_shapes(op, codes, code_bits, scales, mins, lut, group_size)
    check_x(op, x, k, n, bias)
    has_min = mins is not None
    # fp32 activations gather exact table values (the bit trick's GEMV sums are ~1e-5 relative)
    # 8-bit codes (q8_0) gather too: the trick's t - sum x cancellation grows with 2^BITS
    form = table_form(lut) if x.dtype != torch.float32 and code_bits <= 4 else None
    launches = _word_launches(_lowbit_weights(codes, scales, mins, lut), code_bits, words, GROUP=group_size,
                              HAS_MIN=has_min, AFFINE=form is not None, LUT_A=form[0] if form else 1.0,
                              LUT_B=form[1] if form else 0.0, CODEBOOKS=False)
    return linear_launch(op, x, n, launches, bias, f"b{code_bits}_g{group_size}_{'min' if has_min else 'sym'}",
                         config,
                         lambda dtype: lowbit_dequantize(codes, code_bits, scales, mins, lut, group_size, dtype=dtype))


def gcb_linear(x, codes, code_bits, sub_groups, super_scales, codebooks, bias=None, *, config=None):
    """y = x @ W.T + bias for gcb_rowmajor buffers (the op torch_lowbit::gcb_linear)."""
    op = "gcb_linear"
    check_device(op, "x", x, {"codes": codes, "sub_groups": sub_groups, "super_scales": super_scales,
                              "codebooks": codebooks, "bias": bias})
    n, k, words, superblock = _gcb_shapes(op, codes, code_bits, sub_groups, super_scales, codebooks)
    check_x(op, x, k, n, bias)
    table = derived(codebooks, "fp32_flat", lambda t: t.float().reshape(-1))
    weights = (codes.contiguous(), sub_groups.contiguous(), super_scales.contiguous(), table)
    launches = _word_launches(weights, code_bits, words, GROUP=superblock, HAS_MIN=False, AFFINE=False,
                              LUT_A=1.0, LUT_B=0.0, CODEBOOKS=True)
    return linear_launch(op, x, n, launches, bias, f"b{code_bits}_sb{superblock}", config,
                         lambda dtype: gcb_dequantize(codes, code_bits, sub_groups, super_scales, codebooks, dtype=dtype))


def lowbit_dequantize(codes, code_bits, scales, mins, lut, group_size, *, dtype=torch.float32):
    """W [N, K] in `dtype` of stream_rowmajor buffers (the op torch_lowbit::lowbit_dequantize: fp32)."""
    op = "lowbit_dequantize"
    check_device(op, "codes", codes, {"scales": scales, "mins": mins, "lut": lut})
    n, k, words = _lowbit_shapes(op, codes, code_bits, scales, mins, lut, group_size)
    return dequant_launch(_group_dequant_kernel, n, k, _lowbit_weights(codes, scales, mins, lut),
                          dict(ROW_WORDS=words, **_lowbit_consts(code_bits, group_size, mins)), codes.device, dtype)


def gcb_dequantize(codes, code_bits, sub_groups, super_scales, codebooks, *, dtype=torch.float32):
    """W [N, K] in `dtype` of gcb_rowmajor buffers (the op torch_lowbit::gcb_dequantize: fp32)."""
    op = "gcb_dequantize"
    check_device(op, "codes", codes, {"sub_groups": sub_groups, "super_scales": super_scales, "codebooks": codebooks})
    n, k, words, superblock = _gcb_shapes(op, codes, code_bits, sub_groups, super_scales, codebooks)
    return dequant_launch(_group_dequant_kernel, n, k, _gcb_weights(codes, sub_groups, super_scales, codebooks),
                          dict(ROW_WORDS=words, **_gcb_consts(code_bits, superblock)), codes.device, dtype)
