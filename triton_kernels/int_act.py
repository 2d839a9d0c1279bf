"""Integer-activation linear for the lut4_rowmajor layout (QuaRot's W4A8 / W4A4 on CUDA): float
activations rounded per token inside the kernel to int8 codes xq with one fp32 scale xd per token
(any of A8 / A4: the codes are int8 either way), weights decoded to their int8 table values (q4_0 /
int4_pc: c - 8, int4_g*: c, iq4_nl: its integer table) and multiplied with an integer tl.dot
(int8 x int8 -> int32, IMMA tensor cores on sm_80+). Two launches per call, no torch ops around them:
_round_rows_kernel rounds x once (int8 codes, M K bytes), then the matmul kernel reads the codes; where
the M x N tiles are too few to fill the GPU (decode: 64 tiles at N = 4096) the groups are split over
up to 8 K slices whose fp32 partials a third launch sums in a fixed order (split_groups).

Rounding (core/activations.py quantize_per_token, bit for bit): one program per token reads its
row for max|x|, xd = max|x| * (clip / qmax) (1 for an all-zero row), then xq = clamp(rint(x / xd)) —
an IEEE division (div_rn) and round-half-even (adding and subtracting 1.5 * 2^23), as torch does.
(Rounding inside the matmul kernel repeated it per N tile: at M = 64 it was most of the loop.)

Weights, word-wise: a 32-code run of a row is 4 int32 words (lut4_rowmajor: byte j of the run holds
code j in its low nibble and code j + 16 in its high one, so word w's byte j is columns 4 w + j and
4 w + j + 16); each word is cut into its 8 nibbles with compile-time shifts and the nibbles are put
back in column order with joins and reshapes (register moves), instead of loading every byte twice
and shifting it per element.

Math (the CPU kernels' per-token math, csrc/common/lut_i8.h): per group, isum = sum xq * t[c] in
int32; acc += float(isum) * scale (+ float(sum xq) * min); y = acc * xd + bias. The op is
torch_lowbit::lut4_int_linear; torch_lowbit/layouts/lut4.py calls it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_lowbit.core.activations import (ACT_BITS, KERNEL_ACT_BLOCK, KERNEL_ACT_BLOCKS, SUB_BLOCKS, sub_block_multiplier_max,
                                    symmetric_min_code)

from . import autotune
from .lut4 import run_codes
from .matmul import _affine_form, cdiv, check_device, derived, reduce_splits, run_fitting, sm_count

DOT_M = 16  # the smallest M tile an int8 tl.dot takes on GPUs (the interpreter would take less)
RUN = 32  # codes per run of the layout: the kernel's K step (4 int32 words per row)
ROUND_BLOCK = 1024  # features a rounding program reads per step


@triton.jit
def _round_rows_kernel(x_ptr, q_ptr, d_ptr, K, ACT_SCALE, QMIN: tl.constexpr, QMAX: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """Token m's codes q [K] int8 and scale d (fp32) from x [K] (any float dtype); ACT_SCALE: clip / qmax."""
    row = tl.program_id(0).to(tl.int64) * K
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    xd = tl.max(amax, axis=0) * ACT_SCALE
    xd = tl.where(xd > 0, xd, 1.0)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        r = (tl.math.div_rn(x, xd) + 12582912.0) - 12582912.0  # round half to even
        tl.store(q_ptr + row + k0 + offs, tl.minimum(tl.maximum(r, QMIN), QMAX).to(tl.int8), mask=k0 + offs < K)
    tl.store(d_ptr + tl.program_id(0), xd)


@triton.jit
def _round_blocks_kernel(x_ptr, q_ptr, d_ptr, K, ACT_SCALE, QMIN: tl.constexpr, QMAX: tl.constexpr,
                         SUB: tl.constexpr, KMAX: tl.constexpr, BLOCKS: tl.constexpr):
    """Token m's codes q int8 and scales d fp32 [K / 32] for 32-feature blocks [p BLOCKS, (p + 1) BLOCKS)
    (act_codes.quantize_act_codes, bit for bit): SUB = 32, one scale per block; SUB = 16 / 8, the
    two-level scales of quantize_sub_blocks (d per block, an integer multiplier k_j <= KMAX per
    sub-block picked by the same search, codes stored as k_j c). Launched with enable_fp_fusion=False:
    the search's k d - s must be rounded as torch rounds it (a fused multiply-subtract is not)."""
    NSUB: tl.constexpr = 32 // SUB
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    ok = blk < K // 32
    offs = blk[:, None, None] * 32 + tl.arange(0, NSUB)[None, :, None] * SUB + tl.arange(0, SUB)[None, None, :]
    row = tl.program_id(0).to(tl.int64) * K
    x = tl.load(x_ptr + row + offs, mask=ok[:, None, None], other=0.0).to(tl.float32)  # [BLOCKS, NSUB, SUB]
    s = tl.max(tl.abs(x), axis=2) * ACT_SCALE  # each sub-block's own scale [BLOCKS, NSUB]
    if NSUB == 1:
        d = tl.where(s > 0, s, 1.0)
        k = tl.full(s.shape, 1.0, tl.float32)
    else:
        smax = tl.max(s, axis=1)
        live = smax > 0
        best = tl.full(smax.shape, float("inf"), tl.float32)
        d = tl.full(smax.shape, 1.0, tl.float32)
        k = tl.full(s.shape, 1.0, tl.float32)
        for kb in tl.static_range(KMAX, KMAX // 2, -1):  # ties keep the larger kb (the earlier)
            dc = tl.where(live, tl.math.div_rn(smax, kb * 1.0), 1.0)
            kc = (tl.math.div_rn(s, dc[:, None]) + 12582912.0) - 12582912.0
            kc = tl.minimum(tl.maximum(kc, 1.0), KMAX * 1.0)
            miss = tl.where(s > 0, tl.math.div_rn(tl.abs(kc * dc[:, None] - s), tl.where(s > 0, s, 1.0)), 0.0)
            worst = tl.max(miss, axis=1)
            better = worst < best
            best = tl.where(better, worst, best)
            d = tl.where(better, dc, d)
            k = tl.where(better[:, None], kc, k)
        k = tl.where(live[:, None], k, 1.0)
        d = d[:, None]
    step = k * d  # [BLOCKS, NSUB]
    c = (tl.math.div_rn(x, step[:, :, None]) + 12582912.0) - 12582912.0
    c = tl.minimum(tl.maximum(c, QMIN), QMAX) * k[:, :, None]
    tl.store(q_ptr + row + offs, c.to(tl.int8), mask=ok[:, None, None])
    tl.store(d_ptr + tl.program_id(0).to(tl.int64) * (K // 32) + blk, tl.max(d, axis=1), mask=ok)


@triton.jit
def _lut4_int_linear_kernel(q_ptr, d_ptr, qw_ptr, s_ptr, mn_ptr, lut_ptr, b_ptr, y_ptr, ws_ptr, M, N, K,
                            GROUPS_PER_SPLIT, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                            AFFINE: tl.constexpr, LUT_A: tl.constexpr, LUT_B: tl.constexpr, SPLIT_K: tl.constexpr,
                            ACT_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """AFFINE: t[c] = LUT_A c + LUT_B (q4_0, int4_pc: c - 8; int4_g*: c) in integer arithmetic; else a
    gather from the 16-entry int8 table (iq4_nl). q_ptr, d_ptr: the tokens' codes int8 [M, K] and
    scales fp32 [M] (_round_rows_kernel), or with ACT_BLOCKS one scale per 32 features [M, K / 32]
    (_round_blocks_kernel): then each run's int32 product is scaled by its block's scale. qw_ptr: the
    weight codes as int32 words [N, K / 8]; BLOCK_K: one run (RUN). Program (m, n, s) sums groups
    [s G, (s + 1) G) of GROUPS_PER_SPLIT = G; SPLIT_K > 1: its fp32 partial goes to ws [SPLIT_K, M, N]
    (matmul._splitk_reduce_kernel adds them in a fixed order and the bias), else to y with the bias."""
    tl.static_assert(BLOCK_K == 32, "one K step is one 32-code run")
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = offs_m[:, None].to(tl.int64) * K
    if not ACT_BLOCKS:
        xd = tl.load(d_ptr + offs_m, mask=m_ok, other=1.0)
    d_rows = offs_m.to(tl.int64) * (K // BLOCK_K)
    word_rows = offs_n[:, None].to(tl.int64) * (K // 8)
    wl = tl.arange(0, 4)
    g_rows = offs_n.to(tl.int64) * (K // GROUP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g_end = tl.minimum((pid_k + 1) * GROUPS_PER_SPLIT, K // GROUP)
    for g in range(pid_k * GROUPS_PER_SPLIT, g_end):
        scale = tl.load(s_ptr + g_rows + g, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_MIN:
            mn = tl.load(mn_ptr + g_rows + g, mask=n_ok, other=0.0).to(tl.float32)
        isum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        qsum = tl.zeros((BLOCK_M,), dtype=tl.int32)
        for k0 in range(g * GROUP, (g + 1) * GROUP, BLOCK_K):
            xq = tl.load(q_ptr + x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0)
            words = tl.load(qw_ptr + word_rows + (k0 // 8 + wl)[None, :], mask=n_ok[:, None], other=0,
                            eviction_policy="evict_first")
            codes = tl.trans(run_codes(words, BLOCK_N))  # [BLOCK_K, BLOCK_N]
            if AFFINE:  # int8 table values [BLOCK_K, BLOCK_N]
                w = (codes * LUT_A + LUT_B).to(tl.int8)
            else:
                w = tl.load(lut_ptr + codes)
            if ACT_BLOCKS:  # this run's own activation scale: scale its int32 product now
                xdb = tl.load(d_ptr + d_rows + k0 // BLOCK_K, mask=m_ok, other=0.0)
                part = tl.dot(xq, w, out_dtype=tl.int32).to(tl.float32)
                acc += part * xdb[:, None] * scale[None, :]
                if HAS_MIN:
                    acc += (tl.sum(xq.to(tl.int32), axis=1).to(tl.float32) * xdb)[:, None] * mn[None, :]
            else:
                isum = tl.dot(xq, w, acc=isum, out_dtype=tl.int32)
                if HAS_MIN:
                    qsum += tl.sum(xq.to(tl.int32), axis=1)
        if not ACT_BLOCKS:
            acc += isum.to(tl.float32) * scale[None, :]
            if HAS_MIN:
                acc += qsum.to(tl.float32)[:, None] * mn[None, :]
    if ACT_BLOCKS:
        y = acc
    else:
        y = acc * xd[:, None]
    out = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if SPLIT_K > 1:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + out, y, mask=m_ok[:, None] & n_ok[None, :])
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + out, y, mask=m_ok[:, None] & n_ok[None, :])


def split_groups(tiles: int, groups: int, sms: int) -> tuple[int, int]:
    """(SPLIT_K, groups per split): enough K slices that tiles x SPLIT_K is about twice the GPU's SM
    count (at decode the M x N tiles alone are 64 programs for N = 4096: half an H100 idle, 188 GB/s
    there), at most 8, and no empty slice."""
    want = max(1, min(8, groups, -(-2 * sms // max(tiles, 1))))
    per = -(-groups // want)
    return -(-groups // per), per


# (BLOCK_M, BLOCK_N, num_warps): the matmul's tile space. The default (first of its M) is the fixed
# config it ran with before it was tuned: at M = 512 on an H200 that took 863 µs for q4_0 A8 at
# 4096 x 14336, 2.4x the weight-only route (2026-11-27): each 64-row M tile decodes the weights again.
_SMALL_M_TILES = ((16, 64, 4), (16, 32, 4), (16, 128, 4), (16, 128, 8), (16, 256, 8))
# No 128-row tiles: compiled for sm_90 (Triton 3.9) they all hit 255 registers and spill (48-664 B of
# stack); 64 x 256 with 8 warps spends 13.8 instructions per weight of its K loop against the default's
# 27.1 (q4_0, per-token A8), i.e. half the decode work per token tile.
_TILES = ((64, 64, 4), (32, 64, 4), (32, 128, 4), (64, 128, 4), (64, 128, 8), (64, 256, 8))
_STAGES = (2, 3)


def int_act_configs(m: int) -> tuple[list, dict]:
    """(candidates, default) launch configs of the matmul for M tokens: M tiles no larger than M needs
    (16 at decode, the smallest an int8 tl.dot takes on GPUs), each tile in 2 and 3 pipeline stages;
    BLOCK_K is one run (the kernel's K step). The default (used untimed: no GPU, TORCH_LOWBIT_AUTOTUNE=0,
    CUDA-graph capture) is the fixed config of before (32-row M tiles for 17-32 tokens)."""
    tiles = _SMALL_M_TILES if m <= DOT_M else tuple(t for t in _TILES if t[0] <= max(DOT_M, 1 << (m - 1).bit_length()))
    cands = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=RUN, num_warps=w, num_stages=st) for bm, bn, w in tiles
             for st in _STAGES]
    bm, bn, w = tiles[0]
    return cands, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=RUN, num_warps=w, num_stages=3)


def round_activations(x, act_bits, act_clip=1.0, act_block=0):
    """(codes int8 [M, K], scales fp32 [M] or [M, K / 32]) of x float [M, K], bit for bit
    act_codes.quantize_act_codes: one small kernel, one program per token (and per 1024 features with
    blocks)."""
    m, k = x.shape
    qmax = 2 ** (act_bits - 1) - 1
    xq = torch.empty(m, k, dtype=torch.int8, device=x.device)
    if act_block:
        xd = torch.empty(m, k // KERNEL_ACT_BLOCK, dtype=torch.float32, device=x.device)
        blocks = ROUND_BLOCK // KERNEL_ACT_BLOCK
        if m:
            _round_blocks_kernel[(m, cdiv(k // KERNEL_ACT_BLOCK, blocks))](
                x.contiguous(), xq, xd, k, act_clip / qmax, QMIN=symmetric_min_code(act_bits), QMAX=qmax,
                SUB=act_block, KMAX=sub_block_multiplier_max(act_bits) if act_block in SUB_BLOCKS else 1,
                BLOCKS=blocks, num_warps=4, enable_fp_fusion=False)
        return xq, xd
    xd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _round_rows_kernel[(m,)](x.contiguous(), xq, xd, k, act_clip / qmax, QMIN=symmetric_min_code(act_bits),
                                 QMAX=qmax, BLOCK_K=ROUND_BLOCK, num_warps=4)
    return xq, xd


def lut4_int_linear(x, qweight, scales, mins, lut, group_size, bias=None, act_bits=8, act_clip=1.0, act_block=0,
                    *, config=None):
    """fp32 y [M, N] = (x rounded per token to act_bits, clip act_clip; act_block 32 / 16 / 8: per 32
    features, act_codes.quantize_act_codes) @ W.T + bias: x float [M, K], W the lut4_rowmajor weight with
    lut the int8 [16] code values (the op torch_lowbit::lut4_int_linear). config: force the matmul's
    launch config (tests); default: autotune.pick over int_act_configs (on CUDA: timed once per shape)."""
    op = "lut4_int_linear"
    check_device(op, "x", x, {"qweight": qweight, "scales": scales, "mins": mins, "lut": lut, "bias": bias})
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.dim() != 2:
        raise ValueError(f"{op} (triton): x must be float [M, K], got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (n, k // 2):
        raise ValueError(f"{op} (triton): qweight must be uint8 [N, {k // 2}], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise ValueError(f"{op} (triton): group size {group_size} must be a multiple of 32 dividing K={k}")
    if scales.dtype != torch.float16 or tuple(scales.shape) != (n, k // group_size):
        raise ValueError(f"{op} (triton): scales must be fp16 [{n}, {k // group_size}]")
    if mins is not None and (mins.dtype != torch.float16 or mins.shape != scales.shape):
        raise ValueError(f"{op} (triton): mins must be fp16 of the scales' shape")
    if lut.dtype != torch.int8 or lut.numel() != 16:
        raise ValueError(f"{op} (triton): lut must be the 16 int8 code values, got {lut.numel()} {lut.dtype}")
    if act_bits not in ACT_BITS or not 0 < act_clip <= 1:
        raise ValueError(f"{op} (triton): act_bits must be 2, 3, 4 or 8 and act_clip in (0, 1], got "
                         f"{act_bits}, {act_clip}")
    if act_block not in (0,) + KERNEL_ACT_BLOCKS or (act_block in SUB_BLOCKS and act_bits > 4):
        raise ValueError(f"{op} (triton): act_block must be 0 (per token), 32, or 16 / 8 with at most 4 bits; "
                         f"got {act_block} at {act_bits} bits")
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    form = derived(lut, "affine_form", _affine_form)  # one device sync per table, then remembered
    xq, xd = round_activations(x, act_bits, act_clip, act_block)
    groups = k // group_size
    b = bias.float().contiguous() if bias is not None else y
    weights = (qweight.contiguous().view(torch.int32), scales.contiguous(),
               (mins if mins is not None else scales).contiguous(), lut.contiguous())
    consts = dict(GROUP=group_size, HAS_MIN=mins is not None, HAS_BIAS=bias is not None, AFFINE=form is not None,
                  LUT_A=int(form[0]) if form else 1, LUT_B=int(form[1]) if form else 0, ACT_BLOCKS=bool(act_block))

    def run(cfg, warmup=False):
        """The matmul (and split-K reduction) with launch config cfg; warmup: only compile it."""
        cfg = dict(cfg)
        tiles = cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
        split, per_split = split_groups(tiles, groups, sm_count(x.device))
        ws = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else y
        grid = (cdiv(m, cfg["BLOCK_M"]), cdiv(n, cfg["BLOCK_N"]), split)
        kernel = _lut4_int_linear_kernel.warmup if warmup else _lut4_int_linear_kernel[grid]
        kernel(xq, xd, *weights, b, y, ws, m, n, k, per_split, SPLIT_K=split, **consts, **cfg,
               **({"grid": grid} if warmup else {}))
        if split > 1 and not warmup:
            reduce_splits(ws, b, y, bias is not None)

    if config is None:
        cands, default = int_act_configs(m)
        key = (f"m{autotune.m_bucket(m)}_n{n}_k{k}_g{group_size}_{'min' if mins is not None else 'nomin'}_"
               f"{'affine' if form else 'table'}_b{act_block}")
        config = autotune.pick("lut4_int_linear", key, cands, default, run, x.device)
    run_fitting(run, config, ("lut4_int_linear", m <= DOT_M, group_size, act_block), RUN)
    return y
