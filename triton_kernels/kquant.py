"""Fused decode-matmul and dequantize of the K-quants off the CPU (layout kquant_stream, ops/kquant.py):
y = x @ W.T + bias with W[n, k] = (d s) q - dmin m, or (d s) (q - offset) for q3_k / q6_k, where q is
the b-bit code (b = 2 .. 6, one MSB-first stream per row), s the int8 scale and m the uint8 min of
k's sub-block (16 or 32 weights) and d, dmin the fp16 scales of its 256-weight super-block.

`_kquant_linear_kernel` serves both kernel kinds (matmul.py: GEMV for M <= 4, tl.dot above) from whole
stream words, as lowbit._lowbit_linear_kernel does: a unit of G = b / gcd(b, 32) words holds
C = 32 G / b consecutive codes at compile-time shifts (q4_k 8 codes a word, q6_k 16 in 3 words, q3_k
and q5_k 32 in 3 and 5). A unit sits in one super-block (C divides 256) and in H = C / sub-block
sub-blocks (q3_k: 2 halves of 16, every other type 1), so d and dmin are read once per unit and row,
the sub-block's scale and min once per half. GEMV: t = sum x q and sum x per half, then
acc += t (d s) + sum x (-(dmin m) - offset d s): two FMAs per weight (the decode's int->float and
one multiply-add), the scales once per half-unit. tl.dot: each code position's values
q (d s) + low as one [BLOCK_N, units] tile, one tl.dot each (x columns unit + i).
`_kquant_dequant_kernel` writes W per element in the reference's operation order (compiled without
FMA contraction): bit for bit formats.kquants' dequantize.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from torch_lowbit.core.kquant_blocks import SUPER_BLOCK, buffer_problem

from .lowbit import _GEMV_TILES, _row_codes, _word_totals
from .matmul import (WORD_DOT_TILES, KernelLaunch, _acc_init, _acc_total, _bits_at, _epilogue, _fma_or_dot,
                     _gemv_accumulators, _gemv_epilogue, _k_slice, _store_tile, _tiles, _unit_words, _word_fma_rows,
                     _word_step_zeros,
                     check_device, check_x, dequant_launch, linear_launch, quad_tiles)

_SUPER = tl.constexpr(SUPER_BLOCK)  # jit code reads only constexpr globals


@triton.jit
def _kquant_tile(words_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, offs_n, k, N, K, ROW_WORDS, BITS: tl.constexpr,
                 SUB: tl.constexpr, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr):
    """fp32 weights [BLOCK_N, len(k)] in the reference's order: (d * s) * q - dmin * m, or (d * s) * (q - OFFSET)."""
    mask = (offs_n[:, None] < N) & (k[None, :] < K)
    codes = _row_codes(words_ptr, offs_n, k, N, K, ROW_WORDS, BITS)
    rows = offs_n[:, None].to(tl.int64)
    sub_off = rows * (K // SUB) + (k // SUB)[None, :]
    super_off = rows * (K // _SUPER) + (k // _SUPER)[None, :]
    d = tl.load(d_ptr + super_off, mask=mask, other=0.0).to(tl.float32)
    scale = d * tl.load(sc_ptr + sub_off, mask=mask, other=0).to(tl.float32)
    if HAS_MIN:
        dmin = tl.load(dmin_ptr + super_off, mask=mask, other=0.0).to(tl.float32)
        low = dmin * tl.load(mn_ptr + sub_off, mask=mask, other=0).to(tl.float32)
        return scale * codes.to(tl.float32) - low
    else:
        return scale * (codes - OFFSET).to(tl.float32)


@triton.jit
def _kquant_dequant_kernel(words_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, out_ptr, N, K, ROW_WORDS,
                           BITS: tl.constexpr, SUB: tl.constexpr, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W [N, K] (in out's dtype), one tile per program."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = _kquant_tile(words_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, offs_n, k, N, K, ROW_WORDS, BITS, SUB, OFFSET,
                     HAS_MIN)
    _store_tile(out_ptr, w, offs_n, k, K, N, K)


@triton.jit
def _kquant_linear_kernel(x_ptr, words_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, b_ptr, y_ptr, ws_ptr, M, N, K,
                          ROW_WORDS, UNITS_PER_SUB, UNITS_PER_SUPER, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, GEMV: tl.constexpr,
                          DOT_FP32: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr,
                          OFFSET: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """Both kinds (see the module): units of C codes in G words, H parts of L codes, one sub-block each.
    UNITS_PER_SUB / UNITS_PER_SUPER: units a sub-block (1 where H > 1) and a super-block holds, runtime
    divisors: a compile-time one lets Triton give the scale loads a layout of their own, converted
    through shared memory (a barrier) every K step (sm_90 cubins of q4_k: 80 barriers in the loop)."""
    C: tl.constexpr = 32 * G // BITS
    H: tl.constexpr = (C + SUB - 1) // SUB
    L: tl.constexpr = C // H
    U: tl.constexpr = BLOCK_K // C
    pid_m, pid_n, pid_k, offs_m, offs_n = _tiles(GEMV, BLOCK_M, BLOCK_N)
    k_begin, k_end = _k_slice(pid_k, K, SPLIT_K, BLOCK_K)
    u = tl.arange(0, U)
    n_ok = (offs_n < N)[:, None]
    m_ok = (offs_m < M)[:, None]
    rows = offs_n[:, None].to(tl.int64)
    row_words = words_ptr + rows * ROW_WORDS
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * K
    acc = _acc_init(GEMV, BLOCK_M, BLOCK_N, U)
    for k0 in range(k_begin, k_end, BLOCK_K):
        col = k0 + u * C  # each unit's first column
        ok = n_ok & (col < k_end)[None, :]
        unit = k0 // C + u
        word0 = unit * G
        unit_ptr = row_words + word0[None, :]
        super_off = rows * (K // _SUPER) + (unit // UNITS_PER_SUPER)[None, :]
        d = tl.load(d_ptr + super_off, mask=ok, other=0.0).to(tl.float32)
        if HAS_MIN:
            dmin = tl.load(dmin_ptr + super_off, mask=ok, other=0.0).to(tl.float32)
        cur, nxt = 0, 0  # the unit's words, loaded at its first field
        for h in tl.static_range(H):
            if H == 1:
                sub_off = rows * (K // SUB) + (unit // UNITS_PER_SUB)[None, :]
            else:
                sub_off = rows * (K // SUB) + (unit * H + h)[None, :]
            scale = d * tl.load(sc_ptr + sub_off, mask=ok, other=0).to(tl.float32)
            if HAS_MIN:
                low = -(dmin * tl.load(mn_ptr + sub_off, mask=ok, other=0).to(tl.float32))
            else:
                low = scale * (-OFFSET)
            if GEMV:
                t = tl.zeros((BLOCK_M, BLOCK_N, U), dtype=tl.float32)
                x_sum = tl.zeros((BLOCK_M, U), dtype=tl.float32)
            for j in tl.static_range(L):
                # (h L + j: the code's place in the unit, spelled out so that it stays a compile-time constant)
                cur, nxt = _unit_words(unit_ptr, word0, (h * L + j) * BITS, BITS, cur, nxt, 1, G, ROW_WORDS, n_ok)
                q = _bits_at(cur, nxt, ((h * L + j) * BITS) % 32, BITS).to(tl.int32).to(tl.float32)
                x = tl.load(x_rows + (col + h * L + j)[None, :], mask=m_ok & ((col + h * L + j) < k_end)[None, :],
                            other=0.0)
                if GEMV:
                    x = x.to(tl.float32)
                    x_sum += x
                    t += q[None, :, :] * x[:, None, :]
                else:
                    acc = _fma_or_dot(acc, x, q * scale + low, False, DOT_FP32)
            if GEMV:
                acc += t * scale[None, :, :] + x_sum[:, None, :] * low[None, :, :]
    _epilogue(_acc_total(acc, GEMV), offs_m, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS, SPLIT_K)


@triton.jit
def _kquant_gemv_kernel(x_ptr, words_ptr, sc_ptr, mn_ptr, d_ptr, dmin_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, ROW_WORDS,
                        SUB_SHIFT, SUPER_SHIFT, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                        BITS: tl.constexpr, SUB: tl.constexpr, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMV kind (M <= 4) of the types whose codes never straddle a word (q2_k 16 a word, q4_k 8),
    laid out for the memory system as lowbit._lowbit_gemv_kernel is: a thread owns 4 consecutive words
    of a row (one 16-byte load), x is loaded in the words' layout (matmul._word_fma), and each word's
    d s and low (-(dmin m) or -offset d s) come from its sub- and super-block, found by runtime shifts
    (SUB_SHIFT, SUPER_SHIFT: log2 of the words each holds; a compile-time divisor gives those loads a
    layout of their own, a runtime division costs ~20 instructions a word).
    _kquant_linear_kernel's GEMV on these types converted layouts through shared memory every K step
    (sm_90 cubins: q4_k 80 barriers in the loop, 10 instructions a weight)."""
    C: tl.constexpr = 32 // BITS
    QUADS: tl.constexpr = BLOCK_K // (4 * C)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < N)[:, None, None]
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
        sub_off = rows * (K // SUB) + (w >> SUB_SHIFT)
        super_off = rows * (K // _SUPER) + (w >> SUPER_SHIFT)
        scale = tl.load(d_ptr + super_off, mask=ok, other=0.0).to(tl.float32) * \
            tl.load(sc_ptr + sub_off, mask=ok, other=0).to(tl.float32)
        if HAS_MIN:
            low = -(tl.load(dmin_ptr + super_off, mask=ok, other=0.0).to(tl.float32) *
                    tl.load(mn_ptr + sub_off, mask=ok, other=0).to(tl.float32))
        else:
            low = scale * (-OFFSET)
        t0, xs0, t1, xs1, t2, xs2, t3, xs3 = _word_step_zeros(BLOCK_N, QUADS)
        for i in tl.static_range(C):
            q = _bits_at(words, words, i * BITS, BITS).to(tl.int32).to(tl.float32)
            t0, xs0, t1, xs1, t2, xs2, t3, xs3 = _word_fma_rows(q, x_ptr, K, M, w * C + i, w_ok, t0, xs0, t1, xs1,
                                                                t2, xs2, t3, xs3, BLOCK_M)
        # sum x w = (d s) sum x q + low sum x: lowbit's word totals with mins and no affine table
        acc0, acc1, acc2, acc3 = _word_totals(acc0, acc1, acc2, acc3, t0, xs0, t1, xs1, t2, xs2, t3, xs3, scale, low,
                                              1, False, 1.0, 0.0, True, BLOCK_M)
    _gemv_epilogue(acc0, acc1, acc2, acc3, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS, SPLIT_K, BLOCK_M)


# -- launchers -------------------------------------------------------------------------------------
def _shapes(op, *weights):
    """(N, K) of kquant_stream buffers, or a ValueError naming what is wrong."""
    problem, n, k = buffer_problem(*weights)
    if problem is not None:
        raise ValueError(f"{op} (triton): {problem}")
    return n, k


def _weights(codes, sub_scales, sub_mins, d, dmin):
    """The kernels' five weight pointers (the symmetric types pass sub_scales / d for the absent mins)."""
    return (codes.contiguous(), sub_scales.contiguous(), (sub_mins if sub_mins is not None else sub_scales).contiguous(),
            d.contiguous(), (dmin if dmin is not None else d).contiguous())


def kquant_linear(x, codes, code_bits, sub_scales, sub_mins, d, dmin, sub_block, code_offset, bias=None, *,
                  config=None):
    """y = x @ W.T + bias for kquant_stream buffers (the op torch_lowbit::kquant_linear), output in x's
    dtype, any leading dims of x. config: force a launch config (tests, benchmarks)."""
    op = "kquant_linear"
    check_device(op, "x", x, {"codes": codes, "sub_scales": sub_scales, "sub_mins": sub_mins, "d": d, "dmin": dmin,
                              "bias": bias})
    n, k = _shapes(op, codes, code_bits, sub_scales, sub_mins, d, dmin, sub_block, code_offset)
    check_x(op, x, k, n, bias)
    unit_words = code_bits // (code_bits & -code_bits)  # b / gcd(b, 32) for b <= 32
    codes_per_unit = 32 * unit_words // code_bits
    weights = _weights(codes, sub_scales, sub_mins, d, dmin)
    consts = dict(BITS=code_bits, SUB=sub_block, OFFSET=code_offset, HAS_MIN=sub_mins is not None)
    launch = KernelLaunch(_kquant_linear_kernel, weights, dict(G=unit_words, **consts),
                          (codes.shape[1], max(1, sub_block // codes_per_unit), SUPER_BLOCK // codes_per_unit))
    if unit_words == 1:  # q2_k, q4_k: the 16-byte-load GEMV
        tiles = quad_tiles(4 * codes_per_unit)
        shifts = ((sub_block // codes_per_unit).bit_length() - 1, (SUPER_BLOCK // codes_per_unit).bit_length() - 1)
        gemv = KernelLaunch(_kquant_gemv_kernel, weights, consts, (codes.shape[1], *shifts), kind_flags=False,
                            tiles=tiles, default=tiles[0], k_unit=4 * codes_per_unit)
    else:
        gemv = replace(launch, tiles=_GEMV_TILES, default=(64, 256, 4), k_unit=codes_per_unit)
    launches = {"gemv": gemv,
                "dot": replace(launch, tiles=WORD_DOT_TILES, default=(64, 256, 8, 2), k_unit=16 * codes_per_unit)}
    key = f"b{code_bits}_s{sub_block}_o{code_offset}_{'min' if sub_mins is not None else 'sym'}"
    return linear_launch(op, x, n, launches, bias, key, config,
                         lambda dtype: kquant_dequantize(codes, code_bits, sub_scales, sub_mins, d, dmin, sub_block,
                                                         code_offset, dtype=dtype))


def kquant_dequantize(codes, code_bits, sub_scales, sub_mins, d, dmin, sub_block, code_offset, *,
                      dtype=torch.float32):
    """W [N, K] in `dtype` of kquant_stream buffers (the op torch_lowbit::kquant_dequantize: fp32)."""
    op = "kquant_dequantize"
    check_device(op, "codes", codes, {"sub_scales": sub_scales, "sub_mins": sub_mins, "d": d, "dmin": dmin})
    n, k = _shapes(op, codes, code_bits, sub_scales, sub_mins, d, dmin, sub_block, code_offset)
    return dequant_launch(_kquant_dequant_kernel, n, k, _weights(codes, sub_scales, sub_mins, d, dmin),
                          dict(ROW_WORDS=codes.shape[1], BITS=code_bits, SUB=sub_block, OFFSET=code_offset,
                               HAS_MIN=sub_mins is not None), codes.device, dtype)
