"""Fused dequantize-matmul for the lut4_rowmajor layout (q4_0, iq4_nl, int4_g*): y = x @ W.T + bias
with W[n, k] = lut[code] * scale[n, k // group] (+ min), decoded in registers right after the load.

Layout (torch_lowbit/layouts/lut4.py): qweight [N, K/2] uint8, within each run of 32 codes byte j
holds code j (low nibble) and code j+16 (high nibble).
Kernel kinds by M (matmul.kernel_kind): _lut4_gemv_kernel (M <= 4, CUDA cores: a thread owns whole
runs, one 16-byte load each, x loaded in the words' register layout: no shared memory or barrier in
its K loop) and _lut4_linear_kernel (tiled tl.dot), both reading the codes as int32 words;
_lut4_dequant_kernel writes W (large M: dequantize + cuBLAS, and tests) from the same words, cut by
run_codes (which int_act.py's integer kernel uses too). Split-K, configs and the launcher are
matmul.py's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .matmul import WORD_DOT_TILES, KernelLaunch, _acc_init, _acc_total, _epilogue, _fma_or_dot, _gemv_accumulators, \
    _gemv_epilogue, _k_slice, _tiles, _word_fma, check_device, check_x, dequant_launch, linear_launch, table_form


@triton.jit
def _nibbles(words, j: tl.constexpr):
    """(low, high) nibble of byte j of each word: the codes of columns 4 w + j and 4 w + j + 16."""
    byte = (words >> (8 * j)) & 0xFF
    return byte & 0xF, byte >> 4


@triton.jit
def run_codes(words, ROWS: tl.constexpr):
    """int32 codes [ROWS, 32] in column order from each row's run of 4 words [ROWS, 4]: joins put nibble
    j of word w at column 4 w + j (+ 16 for high nibbles) - register moves, not a load per byte."""
    lo0, hi0 = _nibbles(words, 0)
    lo1, hi1 = _nibbles(words, 1)
    lo2, hi2 = _nibbles(words, 2)
    lo3, hi3 = _nibbles(words, 3)
    # join(join(v0, v2), join(v1, v3))[n, w, c, d] = v_{2c + d}: flattened, column 4 w + j
    lo = tl.reshape(tl.join(tl.join(lo0, lo2), tl.join(lo1, lo3)), (ROWS, 16))
    hi = tl.reshape(tl.join(tl.join(hi0, hi2), tl.join(hi1, hi3)), (ROWS, 16))
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (ROWS, 32))  # columns 0-15, then 16-31


@triton.jit
def _lut4_dequant_kernel(qw_ptr, s_ptr, mn_ptr, lut_ptr, out_ptr, N, K, GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W [N, K] (out's dtype) = lut[code] * scale (+ min), BLOCK_N rows x BLOCK_K columns (whole 32-code
    runs) per program, from the codes as int32 words [N, K / 8]: one 16-byte load per row and run, the
    nibbles cut with compile-time shifts (run_codes), one scale (and min) per row and run (GROUP >= 32)."""
    RUNS: tl.constexpr = BLOCK_K // 32
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    run = tl.program_id(1) * RUNS + tl.arange(0, RUNS)
    n_ok = (offs_n < N)[:, None]
    r_ok = (run < K // 32)[None, :]
    rows = offs_n[:, None].to(tl.int64)
    word = run[:, None] * 4 + tl.arange(0, 4)[None, :]  # [RUNS, 4]
    words = tl.load(qw_ptr + rows[:, :, None] * (K // 8) + word[None, :, :], mask=(n_ok & r_ok)[:, :, None],
                    other=0, eviction_policy="evict_first")  # [BLOCK_N, RUNS, 4]
    codes = tl.reshape(run_codes(tl.reshape(words, (BLOCK_N * RUNS, 4)), BLOCK_N * RUNS), (BLOCK_N, RUNS, 32))
    g_off = rows * (K // GROUP) + (run * 32 // GROUP)[None, :]
    scale = tl.load(s_ptr + g_off, mask=n_ok & r_ok, other=0.0).to(tl.float32)
    w = tl.load(lut_ptr + codes, eviction_policy="evict_last") * scale[:, :, None]
    if HAS_MIN:
        w = w + tl.load(mn_ptr + g_off, mask=n_ok & r_ok, other=0.0).to(tl.float32)[:, :, None]
    col = run[:, None] * 32 + tl.arange(0, 32)[None, :]  # [RUNS, 32]
    tl.store(out_ptr + rows[:, :, None] * K + col[None, :, :], w.to(out_ptr.dtype.element_ty),
             mask=(n_ok & r_ok)[:, :, None])


@triton.jit
def _affine_pair(words, j: tl.constexpr):
    """Byte j of each int32 word as two fp32 values, no int->float conversion: the byte's high nibble
    c_hi as 1 + c_hi / 16 and its low nibble c_lo as 1 + c_lo / 256 — one shift puts the high
    nibble in mantissa bits 19..22 and the low one in 15..18, a mask + the exponent of 1.0 makes the
    floats. (Mantissa bits >= 15 keep the codes' products with x exact to ~2^-16 of |x|.)"""
    if j < 2:
        v = words << (15 - 8 * j)
    else:
        v = words >> (8 * j - 15)
    f_hi = ((v & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)
    f_lo = ((v & 0x00078000) | 0x3F800000).to(tl.float32, bitcast=True)
    return f_lo, f_hi


@triton.jit
def _byte_values(words, j: tl.constexpr, lut_ptr, AFFINE: tl.constexpr):
    """(f_lo, f_hi) [BLOCK_N, WORDS] of byte j of each word: AFFINE, _affine_pair's 1 + c / 256 and
    1 + c / 16; else the table's values lut[c_lo], lut[c_hi], gathered from the 64-byte table (one
    L1 line: a warp's gather is one wavefront, where a 2 KiB pair table would take ~14)."""
    if AFFINE:
        f_lo, f_hi = _affine_pair(words, j)
    else:
        byte = words >> (8 * j)
        f_lo = tl.load(lut_ptr + (byte & 0xF), eviction_policy="evict_last")
        f_hi = tl.load(lut_ptr + ((byte >> 4) & 0xF), eviction_policy="evict_last")
    return f_lo, f_hi


@triton.jit
def _lut4_linear_kernel(x_ptr, qw_ptr, s_ptr, mn_ptr, lut_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, GROUP: tl.constexpr,
                        HAS_MIN: tl.constexpr, AFFINE: tl.constexpr, LUT_A: tl.constexpr, LUT_B: tl.constexpr,
                        GEMV: tl.constexpr, DOT_FP32: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = x @ W.T + bias, the tl.dot kind (M > GEMV_MAX_M; the GEMV kind is _lut4_gemv_kernel), over
    the lut4_rowmajor bytes read as int32 words (8 codes each: word w of a 32-code run holds bytes
    4w .. 4w+3, byte j the codes of columns 4w + j (low nibble) and 4w + j + 16 (high)); every byte
    position j is one column of each word, so a K step is 8 slices of WORDS = BLOCK_K / 8 columns (x
    loaded in the same order). The group scale (and min) is read once per word and row (GROUP >= 32
    columns share it). Values (_byte_values): AFFINE tables (lut[c] = LUT_A c + LUT_B: q4_0, int4_g*;
    fp16/bf16 activations) come from _affine_pair's bit trick; other tables (iq4_nl, and any under
    fp32 activations) gathered from lut_ptr. Each slice's weights are value * a + b with per-word a, b
    (scale, min and the affine form folded in: one FMA per weight), then one tl.dot per slice
    (WORDS >= 16)."""
    tl.static_assert(not GEMV, "the GEMV kind of lut4_rowmajor is _lut4_gemv_kernel")
    pid_m, pid_n, pid_k, offs_m, offs_n = _tiles(GEMV, BLOCK_M, BLOCK_N)
    k_begin, k_end = _k_slice(pid_k, K, SPLIT_K, BLOCK_K)
    WORDS: tl.constexpr = BLOCK_K // 8
    wl = tl.arange(0, WORDS)
    col0 = (wl // 4) * 32 + (wl % 4) * 4  # column of each word's byte 0, low nibble
    n_ok = (offs_n < N)[:, None]
    m_ok = (offs_m < M)[:, None]
    word_rows = offs_n[:, None].to(tl.int64) * (K // 8)
    group_rows = offs_n[:, None].to(tl.int64) * (K // GROUP)
    x_rows = offs_m[:, None].to(tl.int64) * K
    acc = _acc_init(GEMV, BLOCK_M, BLOCK_N, WORDS)
    for k0 in range(k_begin, k_end, BLOCK_K):
        w_ok = ((k0 + 8 * wl) < K)[None, :]
        words = tl.load(qw_ptr + word_rows + (k0 // 8 + wl)[None, :], mask=n_ok & w_ok, other=0,
                        eviction_policy="evict_first")
        g_off = group_rows + ((k0 + 32 * (wl // 4)) // GROUP)[None, :]
        scale = tl.load(s_ptr + g_off, mask=n_ok & w_ok, other=0.0).to(tl.float32)
        low = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)  # the min, or 0
        if HAS_MIN:
            low = tl.load(mn_ptr + g_off, mask=n_ok & w_ok, other=0.0).to(tl.float32)
        # value -> weight: A value + B folded with the scale and the min (AFFINE: value = 1 + c / 2^e)
        a_lo = scale * (256.0 * LUT_A if AFFINE else 1.0)
        a_hi = scale * (16.0 * LUT_A if AFFINE else 1.0)
        b_lo = scale * (LUT_B - 256.0 * LUT_A if AFFINE else 0.0) + low
        b_hi = scale * (LUT_B - 16.0 * LUT_A if AFFINE else 0.0) + low
        for j in tl.static_range(4):
            x_col = x_ptr + x_rows + (k0 + col0 + j)[None, :]
            x_lo = tl.load(x_col, mask=m_ok & w_ok, other=0.0)
            x_hi = tl.load(x_col + 16, mask=m_ok & w_ok, other=0.0)
            f_lo, f_hi = _byte_values(words, j, lut_ptr, AFFINE)
            acc = _fma_or_dot(acc, x_lo, f_lo * a_lo + b_lo, False, DOT_FP32)
            acc = _fma_or_dot(acc, x_hi, f_hi * a_hi + b_hi, False, DOT_FP32)
    _epilogue(_acc_total(acc, GEMV), offs_m, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS, SPLIT_K)


@triton.jit
def _byte_fma(f_lo, f_hi, x_ptr, ROW: tl.constexpr, K, M, run, B: tl.constexpr, r_ok, t_lo, t_hi, xs_lo, xs_hi):
    """One x row's products with byte B's values (f_lo, f_hi [BLOCK_N, RUNS, 4]): word q's low nibble
    is column 4 q + B of its run, its high nibble 16 + 4 q + B; accumulated per nibble half, with that
    row's sums of x over the same columns."""
    col = run[None, :, None] * 32 + 4 * tl.arange(0, 4)[None, None, :] + B
    ok = r_ok[None, :, None]
    t_lo, xs_lo = _word_fma(f_lo, x_ptr, ROW, K, M, col, ok, t_lo, xs_lo)
    t_hi, xs_hi = _word_fma(f_hi, x_ptr, ROW, K, M, col + 16, ok, t_hi, xs_hi)
    return t_lo, t_hi, xs_lo, xs_hi


@triton.jit
def _run_total(t_lo, t_hi, xs_lo, xs_hi, scale, low, AFFINE: tl.constexpr, LUT_A: tl.constexpr,
               LUT_B: tl.constexpr, HAS_MIN: tl.constexpr):
    """[BLOCK_N, RUNS]: sum over each run's 32 columns of x * weight. AFFINE: the values were
    1 + c / 256 (low nibbles) and 1 + c / 16 (high), so sum x c = 256 (t_lo - sum x_lo) + 16 (t_hi -
    sum x_hi) and sum x lut[c] = LUT_A sum x c + LUT_B sum x; else t holds sum x lut[c] already.
    The x sums join the products before the sum over each thread's 4 words: a sum of the x tile alone
    would come out in another layout and cost a shared-memory conversion (and barrier) per step."""
    if AFFINE and HAS_MIN:  # the min joins the x sums' coefficients (a separate sum of x * min: barriers)
        c_lo = scale * (LUT_B - 256.0 * LUT_A) + low
        c_hi = scale * (LUT_B - 16.0 * LUT_A) + low
        inner = ((256.0 * LUT_A) * t_lo + (16.0 * LUT_A) * t_hi) * scale[:, :, None] \
            + c_lo[:, :, None] * xs_lo + c_hi[:, :, None] * xs_hi
        total = tl.sum(inner, axis=2)
    elif AFFINE:
        inner = (256.0 * LUT_A) * t_lo + (16.0 * LUT_A) * t_hi \
            + ((LUT_B - 256.0 * LUT_A) * xs_lo + (LUT_B - 16.0 * LUT_A) * xs_hi)
        total = tl.sum(inner, axis=2) * scale
    else:
        total = tl.sum(t_lo + t_hi, axis=2) * scale
        if HAS_MIN:
            total += tl.sum((xs_lo + xs_hi) * low[:, :, None], axis=2)
    return total


@triton.jit
def _lut4_gemv_kernel(x_ptr, qw_ptr, s_ptr, mn_ptr, lut_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, ROW_WORDS, ROW_GROUPS,
                      GROUP_RUNS,
                      HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
                      AFFINE: tl.constexpr, LUT_A: tl.constexpr, LUT_B: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = x @ W.T + bias for M <= 4 rows of x (BLOCK_M 1, 2 or 4) on the CUDA cores, laid out for the
    memory system: a thread owns whole 32-code runs (4 int32 words: one 16-byte load per row and run,
    consecutive threads on consecutive runs of a row, so a warp's loads are contiguous), decodes each
    word's bytes with _byte_values (AFFINE: the mantissa trick, else the table) and multiplies them
    with x loaded in the words' own register layout (_byte_fma): no shared memory, no barrier in
    the K loop (sm_90 cubin: tools/triton_compile_check). The group scale (and min) is applied once
    per row and run (GROUP >= 32), the sum across threads once after the loop. A K step is BLOCK_K / 32
    runs; split-K slices are whole steps (matmul._epilogue's partials)."""
    RUNS: tl.constexpr = BLOCK_K // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_begin, r_end = _k_slice(pid_k, K // 32, SPLIT_K, RUNS)  # in runs
    n_ok = offs_n < N
    word_rows = offs_n[:, None, None].to(tl.int64) * ROW_WORDS
    group_rows = offs_n[:, None].to(tl.int64) * ROW_GROUPS
    quad = tl.arange(0, 4)[None, None, :]
    acc0, acc1, acc2, acc3 = _gemv_accumulators(BLOCK_N, RUNS)  # one per x row
    for r0 in range(r_begin, r_end, RUNS):
        run = r0 + tl.arange(0, RUNS)
        r_ok = run < r_end
        words = tl.load(qw_ptr + word_rows + (run * 4)[None, :, None] + quad,
                        mask=n_ok[:, None, None] & r_ok[None, :, None], other=0, eviction_policy="evict_first")
        g_off = group_rows + (run // GROUP_RUNS)[None, :]  # a runtime divisor, see the launcher
        g_ok = n_ok[:, None] & r_ok[None, :]
        scale = tl.load(s_ptr + g_off, mask=g_ok, other=0.0).to(tl.float32)
        low = scale
        if HAS_MIN:
            low = tl.load(mn_ptr + g_off, mask=g_ok, other=0.0).to(tl.float32)
        zero = tl.zeros((BLOCK_N, RUNS, 4), dtype=tl.float32)
        zero_x = tl.zeros((1, RUNS, 4), dtype=tl.float32)
        t_lo0, t_hi0, xs_lo0, xs_hi0 = zero, zero, zero_x, zero_x
        t_lo1, t_hi1, xs_lo1, xs_hi1 = zero, zero, zero_x, zero_x
        t_lo2, t_hi2, xs_lo2, xs_hi2 = zero, zero, zero_x, zero_x
        t_lo3, t_hi3, xs_lo3, xs_hi3 = zero, zero, zero_x, zero_x
        for b in tl.static_range(4):
            f_lo, f_hi = _byte_values(words, b, lut_ptr, AFFINE)
            t_lo0, t_hi0, xs_lo0, xs_hi0 = _byte_fma(f_lo, f_hi, x_ptr, 0, K, M, run, b, r_ok,
                                                     t_lo0, t_hi0, xs_lo0, xs_hi0)
            if BLOCK_M > 1:
                t_lo1, t_hi1, xs_lo1, xs_hi1 = _byte_fma(f_lo, f_hi, x_ptr, 1, K, M, run, b, r_ok,
                                                         t_lo1, t_hi1, xs_lo1, xs_hi1)
            if BLOCK_M > 2:
                t_lo2, t_hi2, xs_lo2, xs_hi2 = _byte_fma(f_lo, f_hi, x_ptr, 2, K, M, run, b, r_ok,
                                                         t_lo2, t_hi2, xs_lo2, xs_hi2)
                t_lo3, t_hi3, xs_lo3, xs_hi3 = _byte_fma(f_lo, f_hi, x_ptr, 3, K, M, run, b, r_ok,
                                                         t_lo3, t_hi3, xs_lo3, xs_hi3)
        acc0 += _run_total(t_lo0, t_hi0, xs_lo0, xs_hi0, scale, low, AFFINE, LUT_A, LUT_B, HAS_MIN)
        if BLOCK_M > 1:
            acc1 += _run_total(t_lo1, t_hi1, xs_lo1, xs_hi1, scale, low, AFFINE, LUT_A, LUT_B, HAS_MIN)
        if BLOCK_M > 2:
            acc2 += _run_total(t_lo2, t_hi2, xs_lo2, xs_hi2, scale, low, AFFINE, LUT_A, LUT_B, HAS_MIN)
            acc3 += _run_total(t_lo3, t_hi3, xs_lo3, xs_hi3, scale, low, AFFINE, LUT_A, LUT_B, HAS_MIN)
    _gemv_epilogue(acc0, acc1, acc2, acc3, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS, SPLIT_K, BLOCK_M)


# The GEMV's (BLOCK_N, BLOCK_K, num_warps) space: BLOCK_K / 32 runs a K step and thread; up to 16 runs a
# step the x tiles share the words' layout (32 put a conversion through shared memory back, sm_90).
GEMV_RUN_TILES = ((16, 512, 4), (32, 512, 4), (32, 256, 4), (64, 256, 4), (64, 512, 8), (128, 256, 8))


def _check_args(op, ref_name, ref, qweight, scales, mins, lut, group_size):
    """Clear errors (with the fix) for what the kernels cannot read; returns (N, K)."""
    check_device(op, ref_name, ref, {"qweight": qweight, "scales": scales, "mins": mins, "lut": lut})
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"{op} (triton): qweight must be 2-D uint8 [N, K/2], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise ValueError(f"{op} (triton): group size {group_size} must be a multiple of 32 dividing K={k}; "
                         "pick a group size that divides in_features")
    if scales.dtype != torch.float16 or tuple(scales.shape) != (n, k // group_size):
        raise ValueError(f"{op} (triton): scales must be fp16 [{n}, {k // group_size}], got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if mins is not None and (mins.dtype != torch.float16 or mins.shape != scales.shape):
        raise ValueError(f"{op} (triton): mins must be fp16 of the scales' shape")
    if lut.dtype != torch.float32 or lut.numel() != 16:
        raise ValueError(f"{op} (triton): lut must be 16 fp32 values (the format's code_values()), got "
                         f"{lut.numel()} {lut.dtype}")
    return n, k


def _weights(qweight, scales, mins, lut):
    return (qweight.contiguous(), scales.contiguous(), mins.contiguous() if mins is not None else scales,
            lut.contiguous())


def lut4_linear(x, qweight, scales, mins, lut, group_size, bias=None, *, config=None):
    """y = x @ W.T + bias in x's dtype (fp32 accumulation), any leading dims of x (the op
    torch_lowbit::lut4_linear). config: force a launch config (tests, benchmarks)."""
    op = "lut4_linear"
    n, k = _check_args(op, "x", x, qweight, scales, mins, lut, group_size)
    check_device(op, "x", x, {"bias": bias})
    check_x(op, x, k, n, bias)
    weights = _weights(qweight, scales, mins, lut)
    # The bit trick's GEMV sums are exact to ~1e-5 relative: far below an fp16/bf16 output's rounding,
    # not an fp32 one's, so fp32 activations take exact table lookups.
    form = table_form(lut) if x.dtype != torch.float32 else None
    words = (weights[0].view(torch.int32),) + weights[1:]  # 8 codes a word
    consts = dict(GROUP=group_size, HAS_MIN=mins is not None, AFFINE=form is not None,
                  LUT_A=form[0] if form else 1.0, LUT_B=form[1] if form else 0.0)
    # ROW_WORDS, ROW_GROUPS as arguments: Triton specializes them on divisibility by 16, which is what
    # lets the GEMV's row loads be 16-byte vectors. GROUP_RUNS (runs per group) too: a compile-time
    # divisor > 1 lets Triton see runs sharing a scale and load the scales in a layout of their own,
    # converted through shared memory (a barrier) every K step (sm_90 cubin of int4_g128)
    launches = {"gemv": KernelLaunch(_lut4_gemv_kernel, words, consts,
                                     sizes=(k // 8, k // group_size, group_size // 32),
                                     kind_flags=False, tiles=GEMV_RUN_TILES, default=(32, 256, 4), k_unit=32),
                "dot": KernelLaunch(_lut4_linear_kernel, words, consts, tiles=WORD_DOT_TILES, default=(64, 128, 4, 2),
                                    k_unit=128)}
    return linear_launch(op, x, n, launches, bias, f"g{group_size}", config,
                         lambda dtype: lut4_dequantize(qweight, scales, mins, lut, group_size, dtype=dtype))


def lut4_dequantize(qweight, scales, mins, lut, group_size, *, dtype=torch.float32):
    """W [N, K] in `dtype` (the op torch_lowbit::lut4_dequantize: fp32)."""
    n, k = _check_args("lut4_dequantize", "qweight", qweight, qweight, scales, mins, lut, group_size)
    qw, s, mn, tab = _weights(qweight, scales, mins, lut)
    # 32 rows x 4 runs a program (4096 weights, 32 a thread)
    return dequant_launch(_lut4_dequant_kernel, n, k, (qw.view(torch.int32), s, mn, tab),
                          dict(GROUP=group_size, HAS_MIN=mins is not None), qweight.device, dtype, block_n=32,
                          block_k=128)
