"""Fused dequantize-matmul for the lut4_rowmajor layout (q4_0, iq4_nl, int4_g*): y = x @ W.T + bias
with W[n, k] = lut[code] * scale[n, k // group] (+ min), decoded in registers right after the load.

Layout (torch_lowbit/layouts/lut4.py): qweight [N, K/2] uint8, within each run of 32 codes byte j
holds code j (low nibble) and code j+16 (high nibble); the 16-entry table is staged in registers.
Kernel kinds by M (split-K GEMV / tiled tl.dot / dequantize + cuBLAS), split-K, staging, configs
and the launcher are matmul.py's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .matmul import (_epilogue, _k_slice, _lookup, _mac, _stage_table, _store_tile, _tiles, check_device, check_x,
                     dequant_launch, linear_launch)


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
def _lut4_linear_kernel(x_ptr, qw_ptr, s_ptr, mn_ptr, lut_ptr, b_ptr, y_ptr, ws_ptr, M, N, K,
                        GROUP: tl.constexpr, HAS_MIN: tl.constexpr, GEMV: tl.constexpr, DOT_FP32: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, STAGE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_k, offs_m, offs_n = _tiles(GEMV, BLOCK_M, BLOCK_N)
    x_rows = offs_m[:, None].to(tl.int64) * K
    k_begin, k_end = _k_slice(pid_k, K, SPLIT_K, BLOCK_K)
    lut = _stage_table(lut_ptr, 16, STAGE)  # once per program
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = _decode_tile(qw_ptr, s_ptr, mn_ptr, lut, offs_n, k, N, K, GROUP, HAS_MIN, STAGE)
        acc = _mac(acc, x_ptr, x_rows, offs_m, M, k, K, w, GEMV, DOT_FP32)
    _epilogue(acc, offs_m, offs_n, pid_k, M, N, b_ptr, y_ptr, ws_ptr, HAS_BIAS, SPLIT_K)


@triton.jit
def _lut4_dequant_kernel(qw_ptr, s_ptr, mn_ptr, lut_ptr, out_ptr, N, K, GROUP: tl.constexpr,
                         HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = _decode_tile(qw_ptr, s_ptr, mn_ptr, lut_ptr, offs_n, k, N, K, GROUP, HAS_MIN, False)
    _store_tile(out_ptr, w, offs_n, k, K, N, K)


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
    return linear_launch(op, _lut4_linear_kernel, x, n, _weights(qweight, scales, mins, lut), (),
                         dict(GROUP=group_size, HAS_MIN=mins is not None), bias, f"g{group_size}", config,
                         lambda dtype: lut4_dequantize(qweight, scales, mins, lut, group_size, dtype=dtype),
                         table_values=16)


def lut4_dequantize(qweight, scales, mins, lut, group_size, *, dtype=torch.float32):
    """W [N, K] in `dtype` (the op torch_lowbit::lut4_dequantize: fp32)."""
    n, k = _check_args("lut4_dequantize", "qweight", qweight, qweight, scales, mins, lut, group_size)
    return dequant_launch(_lut4_dequant_kernel, n, k, _weights(qweight, scales, mins, lut),
                          dict(GROUP=group_size, HAS_MIN=mins is not None), qweight.device, dtype)
