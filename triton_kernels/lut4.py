"""Fused dequantize-matmul for the lut4_rowmajor layout (q4_0, iq4_nl, int4_g*): y = x @ W.T + bias
with W[n, k] = lut[code] * scale[n, k // group] (+ min), decoded in registers right after the load.

Layout (torch_lowbit/layouts/lut4.py): qweight [N, K/2] uint8, within each run of 32 codes byte j
holds code j (low nibble) and code j+16 (high nibble).

Two kernels, chosen by M (the number of activation rows):
- M <= GEMV_MAX_M: `_lut4_gemv_kernel`, CUDA-core split-K GEMV (GemLite's GEMV_SPLITK, Q-Palette's
  CUDA-core kernels). Each program owns BLOCK_N outputs and one of SPLIT_K slices of K, decodes a
  [BLOCK_N, BLOCK_K] weight tile and multiplies it with all M rows by broadcast FMAs. Why not
  tensor cores: a tl.dot tile is at least 16 rows, and at M <= 4 the 2*M flops per weight stay
  below what the CUDA cores sustain at HBM speed (H100: 3.35 TB/s / 0.5625 B per q4_0 weight ->
  6e12 weights/s -> 48 TFLOPS at M = 4 vs 67 fp32), so the kernel stays memory-bound either way
  and split-K gives enough programs to fill the GPU at small N.
- M > GEMV_MAX_M: `_lut4_matmul_kernel`, tiled tl.dot (fp16/bf16 tensor cores; exact fp32 products
  for fp32 activations). The grid's fastest axis is M, so the programs of one N-tile run together
  and its weight is read from HBM once (then L2). Optional split-K for medium M and small N.
With SPLIT_K > 1 each program writes fp32 partials and `_splitk_reduce_kernel` sums them in a
fixed order (deterministic, unlike atomics), adds the bias and casts; with SPLIT_K == 1 the matmul
kernel does that epilogue itself. Launch configs come from triton_kernels/autotune.py.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import autotune
from .autotune import INTERPRET

GEMV_MAX_M = 4  # M <= this: CUDA-core GEMV kernel; above: tl.dot kernel (see the module docstring)
_ACTS = (torch.float32, torch.bfloat16, torch.float16)


# -- codebook staging -----------------------------------------------------------------------------
# A table of at most STAGE_MAX_VALUES fp32 values (the 16-entry 4-bit LUTs, nuq1..4, vq1.5, vq2) is
# loaded into registers once per program and every tile's lookups are `tl.gather`s from it (VQ-LLM's
# codebook cache: on chip, never reloaded per tile). Larger tables (vq2.5+, the TCQ hybrid code's
# 2^(Q+1) x 2) would cost BLOCK_N x size registers as a gather source; they stay gathers from
# global memory, loaded evict_last while the streamed codes go evict_first, so the table is what
# L1 keeps. Whether staging wins is GPU-specific: STAGE is an autotuned config field.
STAGE_MAX_VALUES = 32


@triton.jit
def _stage_table(tbl_ptr, SIZE: tl.constexpr, STAGE: tl.constexpr):
    """STAGE: the table's SIZE values in registers (one load per program); else its pointer."""
    if STAGE:
        return tl.load(tbl_ptr + tl.arange(0, SIZE))
    else:
        return tbl_ptr


@triton.jit
def _lookup(table, idx, SIZE: tl.constexpr, STAGE: tl.constexpr):
    """table[idx] for a 2-D int32 idx: a register gather from the staged table, or a global gather."""
    if STAGE:
        return tl.gather(tl.broadcast_to(table[None, :], (idx.shape[0], SIZE)), idx, axis=1)
    else:
        return tl.load(table + idx, eviction_policy="evict_last")


def stage_table(size: int) -> bool:
    """The default STAGE for a table of `size` fp32 values (autotuning tries both where allowed)."""
    return size <= STAGE_MAX_VALUES


def with_stage(candidates, size: int) -> list:
    """The launch-config space times the STAGE choices a table of `size` values allows."""
    choices = (True, False) if stage_table(size) else (False,)
    return [dict(c, STAGE=s) for c in candidates for s in choices]


@triton.jit
def _decode_tile(qw_ptr, s_ptr, mn_ptr, lut, offs_n, k, N, K, GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
                 STAGE: tl.constexpr):
    """fp32 weights [BLOCK_N, BLOCK_K] for rows offs_n and columns k (k % 32 order as in the layout);
    lut: _stage_table's result."""
    mask = (offs_n[:, None] < N) & (k[None, :] < K)
    byte = (k // 32) * 16 + (k % 16)
    shift = ((k % 32) // 16) * 4
    rows = offs_n[:, None].to(tl.int64)
    packed = tl.load(qw_ptr + rows * (K // 2) + byte[None, :], mask=mask, other=0, eviction_policy="evict_first")
    codes = (packed.to(tl.int32) >> shift[None, :]) & 0xF
    return _apply_groups(_lookup(lut, codes, 16, STAGE), s_ptr, mn_ptr, offs_n, k, N, K, GROUP, HAS_MIN)


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
def _k_slice(pid_k, K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[begin, end) of this program's K slice: whole BLOCK_K blocks, only the last meets K's edge."""
    k_len = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_len
    return k_begin, tl.minimum(k_begin + k_len, K)


@triton.jit
def _lut4_gemv_kernel(x_ptr, qw_ptr, s_ptr, mn_ptr, lut_ptr, b_ptr, y_ptr, ws_ptr, M, N, K,
                      GROUP: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SPLIT_K: tl.constexpr, STAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)  # all M rows (M <= BLOCK_M)
    x_rows = offs_m[:, None].to(tl.int64) * K
    k_begin, k_end = _k_slice(pid_k, K, SPLIT_K, BLOCK_K)
    lut = _stage_table(lut_ptr, 16, STAGE)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = _decode_tile(qw_ptr, s_ptr, mn_ptr, lut, offs_n, k, N, K, GROUP, HAS_MIN, STAGE)
        # fp32 right after the load: CUDA-core FMAs in fp32 (and the interpreter mis-reads bf16 math)
        x = tl.load(x_ptr + x_rows + k[None, :], mask=(offs_m[:, None] < M) & (k[None, :] < K),
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    _epilogue(acc, offs_m, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS, SPLIT_K)


@triton.jit
def _lut4_matmul_kernel(x_ptr, qw_ptr, s_ptr, mn_ptr, lut_ptr, b_ptr, y_ptr, ws_ptr, M, N, K,
                        GROUP: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                        DOT_FP32: tl.constexpr, SPLIT_K: tl.constexpr, STAGE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)  # fastest grid axis: the M tiles of one N tile share its weight in L2
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = offs_m[:, None].to(tl.int64) * K
    k_begin, k_end = _k_slice(pid_k, K, SPLIT_K, BLOCK_K)
    lut = _stage_table(lut_ptr, 16, STAGE)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + x_rows + k[None, :], mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = _decode_tile(qw_ptr, s_ptr, mn_ptr, lut, offs_n, k, N, K, GROUP, HAS_MIN, STAGE)
        if DOT_FP32:  # fp32 activations (exact products), or bf16 under the interpreter
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:  # fp16/bf16 tensor cores, fp32 accumulation
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    _epilogue(acc, offs_m, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS, SPLIT_K)


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


@triton.jit
def _lut4_dequant_kernel(qw_ptr, s_ptr, mn_ptr, lut_ptr, out_ptr, N, K, GROUP: tl.constexpr,
                         HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = _decode_tile(qw_ptr, s_ptr, mn_ptr, lut_ptr, offs_n, k, N, K, GROUP, HAS_MIN, False)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * K + k[None, :], w,
             mask=(offs_n[:, None] < N) & (k[None, :] < K))


# -- launch configs ------------------------------------------------------------------------------
# GEMV: BLOCK_N x BLOCK_K weight tile times BLOCK_M (<= 4) rows lives in registers as a 3-D product:
# BLOCK_N * BLOCK_K / threads <= 32 values per row and thread.
_GEMV_TILES = ((16, 256, 4), (32, 128, 4), (64, 64, 4), (32, 256, 8), (64, 128, 8))
_DOT_TILES = ((16, 64, 128, 4), (16, 128, 64, 4), (32, 64, 64, 4), (32, 128, 64, 4), (64, 64, 64, 4),
              (64, 128, 64, 4), (128, 64, 64, 4), (128, 128, 64, 8), (128, 256, 64, 8))
_SPLITS = (1, 2, 4, 8)


def _gemv_candidates(m, n, k):
    return [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=2)
            for bn, bk, w in _GEMV_TILES for sk in _SPLITS if sk * bk <= k]


def _gemv_default(m, n, k):
    # A few K slices even on small shapes, so the interpreter tests exercise the split-K reduction.
    return dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=max(1, min(4, triton.cdiv(k, 64))), num_warps=4, num_stages=2)


def _dot_candidates(m, n, k):
    # Split K only while the M x N tiles alone are too few to fill a GPU (M <= 64).
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=3)
            for bm, bn, bk, w in _DOT_TILES if bm <= max(16, autotune.m_bucket(m))
            for sk in (_SPLITS[:3] if m <= 64 else (1,)) if sk * bk <= k]


def _dot_default(m, n, k):
    bm = 16 if m <= 16 else 32 if m <= 32 else 64  # GPU-valid tl.dot tiles (M, N, K >= 16)
    return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=3)


# -- launchers -----------------------------------------------------------------------------------
def _check_args(x, qweight, scales, mins, lut, group_size, bias):
    """Clear errors (with the fix) for what the kernels cannot read; returns (N, K)."""
    if x.dtype not in _ACTS:
        raise TypeError(f"lut4_linear (triton): activations must be float32, bfloat16 or float16, got {x.dtype}; "
                        "cast them with .to(torch.float16) or similar")
    for name, t in (("qweight", qweight), ("scales", scales), ("mins", mins), ("lut", lut), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"lut4 (triton): {name} is on {t.device} but x is on {x.device}; move the "
                             "module or the input with .to()")
    if x.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("lut4 (triton): CPU tensors run only under the Triton interpreter; set "
                           "TRITON_INTERPRET=1 before importing torch_lowbit, or move the tensors to CUDA")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"lut4 (triton): qweight must be 2-D uint8 [N, K/2], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise ValueError(f"lut4 (triton): group size {group_size} must be a multiple of 32 dividing K={k}; "
                         "pick a group size that divides in_features")
    if scales.dtype != torch.float16 or tuple(scales.shape) != (n, k // group_size):
        raise ValueError(f"lut4 (triton): scales must be fp16 [{n}, {k // group_size}], got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if mins is not None and (mins.dtype != torch.float16 or mins.shape != scales.shape):
        raise ValueError("lut4 (triton): mins must be fp16 of the scales' shape")
    if lut.dtype != torch.float32 or lut.numel() != 16:
        raise ValueError(f"lut4 (triton): lut must be 16 fp32 values (the format's code_values()), got "
                         f"{lut.numel()} {lut.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"lut4_linear (triton): x has {x.shape[-1]} features, the weight has K={k}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"lut4_linear (triton): bias must have {n} elements, got {tuple(bias.shape)}")
    return n, k


def _launch(kind, x2, qw, sc, mn, lt, bias, y, group_size, has_min, cfg):
    m, k = x2.shape
    n = qw.shape[0]
    cfg = dict(cfg)
    cfg.setdefault("STAGE", stage_table(16))  # forced configs may leave it out
    split = cfg.pop("SPLIT_K")
    # fp32 partials of each K slice (every element written: no zero-fill needed)
    ws = torch.empty((split, m, n), device=x2.device, dtype=torch.float32) if split > 1 else y
    b = bias if bias is not None else sc
    common = dict(GROUP=group_size, HAS_MIN=has_min, HAS_BIAS=bias is not None and split == 1, SPLIT_K=split)
    if kind == "gemv":
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), split)
        _lut4_gemv_kernel[grid](x2, qw, sc, mn, lt, b, y, ws, m, n, k, BLOCK_M=triton.next_power_of_2(m),
                                **common, **cfg)
    else:
        dot_fp32 = x2.dtype == torch.float32 or (INTERPRET and x2.dtype == torch.bfloat16)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
        _lut4_matmul_kernel[grid](x2, qw, sc, mn, lt, b, y, ws, m, n, k, DOT_FP32=dot_fp32, **common, **cfg)
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](ws, b, y, m * n, n, HAS_BIAS=bias is not None,
                                                            SPLIT_K=split, BLOCK=block)
    return y


def kernel_kind(m: int) -> str:
    """'gemv' (CUDA-core split-K) for M <= GEMV_MAX_M, else 'dot' (tiled tl.dot)."""
    return "gemv" if m <= GEMV_MAX_M else "dot"


def lut4_linear(x, qweight, scales, mins, lut, group_size, bias=None, *, config=None):
    """y = x @ W.T + bias in x's dtype (fp32 accumulation), any leading dims of x.

    config: force a launch config (tests, benchmarks); default: autotune.pick (fixed default without
    a GPU timer, the tuned one on CUDA)."""
    n, k = _check_args(x, qweight, scales, mins, lut, group_size, bias)
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    # The interpreter stores bf16 by truncation: give it an fp32 output and round once on the host.
    out_dtype = torch.float32 if INTERPRET and x.dtype == torch.bfloat16 else x.dtype
    y = torch.empty((m, n), device=x.device, dtype=out_dtype)
    if m:
        kind = kernel_kind(m)
        run = functools.partial(_launch, kind, x2, qweight.contiguous(), scales.contiguous(),
                                mins.contiguous() if mins is not None else scales, lut.contiguous(), bias, y,
                                group_size, mins is not None)
        if config is None:
            cands, default = (_gemv_candidates, _gemv_default) if kind == "gemv" else (_dot_candidates, _dot_default)
            key = f"m{autotune.m_bucket(m)}_n{n}_k{k}_g{group_size}_{str(x.dtype).removeprefix('torch.')}"
            config = autotune.pick(f"lut4_{kind}", key, with_stage(cands(m, n, k), 16), default(m, n, k), run,
                                   x.device)
        run(config)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def lut4_dequantize(qweight, scales, mins, lut, group_size):
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError("lut4_dequantize (triton): qweight must be 2-D uint8 [N, K/2]")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    _check_args(torch.empty((0, k), device=qweight.device), qweight, scales, mins, lut, group_size, None)
    out = torch.empty((n, k), device=qweight.device, dtype=torch.float32)
    block_n, block_k = 32, 64
    _lut4_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight.contiguous(), scales.contiguous(), mins.contiguous() if mins is not None else scales,
        lut.contiguous(), out, n, k, GROUP=group_size, HAS_MIN=mins is not None, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
