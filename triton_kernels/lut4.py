"""Fused dequantize-matmul for the lut4_rowmajor layout (q4_0, iq4_nl, int4_g*): y = x @ W.T + bias
with W[n, k] = lut[code] * scale[n, k // group] (+ min), decoded in registers right after the load.

Layout (torch_lowbit/layouts/lut4.py): qweight [N, K/2] uint8, within each run of 32 codes byte j
holds code j (low nibble) and code j+16 (high nibble); the 16-entry table is staged in registers.
This file is the tile decoder; the kernels (matmul._group_linear_kernel / _group_dequant_kernel, kinds
by M: split-K GEMV / tiled tl.dot / dequantize + cuBLAS), split-K, staging, configs and the launcher
are matmul.py's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .matmul import _group_dequant_kernel, _group_linear_kernel, _lookup, check_device, check_x, dequant_launch, \
    linear_launch


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
def _decode_tile(qw_ptr, s_ptr, mn_ptr, lut, offs_n, k, N, K, ROW_WORDS, BITS: tl.constexpr, GROUP: tl.constexpr,
                 HAS_MIN: tl.constexpr, STAGE: tl.constexpr):
    """fp32 weights [BLOCK_N, len(k)] for rows offs_n and columns k (k % 32 order as in the layout);
    lut: the staged table or its pointer. matmul's group-kernel decoder signature (ROW_WORDS, BITS unused)."""
    mask = (offs_n[:, None] < N) & (k[None, :] < K)
    byte = (k // 32) * 16 + (k % 16)
    shift = ((k % 32) // 16) * 4
    rows = offs_n[:, None].to(tl.int64)
    packed = tl.load(qw_ptr + rows * (K // 2) + byte[None, :], mask=mask, other=0, eviction_policy="evict_first")
    codes = (packed.to(tl.int32) >> shift[None, :]) & 0xF
    return _apply_groups(_lookup(lut, codes, 16, STAGE), s_ptr, mn_ptr, offs_n, k, N, K, GROUP, HAS_MIN)


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


def _consts(group_size, mins):
    return dict(DECODE=_decode_tile, BITS=4, GROUP=group_size, HAS_MIN=mins is not None)


def lut4_linear(x, qweight, scales, mins, lut, group_size, bias=None, *, config=None):
    """y = x @ W.T + bias in x's dtype (fp32 accumulation), any leading dims of x (the op
    torch_lowbit::lut4_linear). config: force a launch config (tests, benchmarks)."""
    op = "lut4_linear"
    n, k = _check_args(op, "x", x, qweight, scales, mins, lut, group_size)
    check_device(op, "x", x, {"bias": bias})
    check_x(op, x, k, n, bias)
    return linear_launch(op, _group_linear_kernel, x, n, _weights(qweight, scales, mins, lut), (0,),
                         _consts(group_size, mins), bias, f"g{group_size}", config,
                         lambda dtype: lut4_dequantize(qweight, scales, mins, lut, group_size, dtype=dtype),
                         table_values=16)


def lut4_dequantize(qweight, scales, mins, lut, group_size, *, dtype=torch.float32):
    """W [N, K] in `dtype` (the op torch_lowbit::lut4_dequantize: fp32)."""
    n, k = _check_args("lut4_dequantize", "qweight", qweight, qweight, scales, mins, lut, group_size)
    return dequant_launch(_group_dequant_kernel, n, k, _weights(qweight, scales, mins, lut),
                          dict(ROW_WORDS=0, **_consts(group_size, mins)), qweight.device, dtype)
