"""Fused dequantize-matmul for the lut4_rowmajor layout (q4_0, int4_g*): y = x @ W.T + bias with
W[n, k] = lut[code] * scale[n, k // group] (+ min), decoded in registers right after the load.

Layout (torch_lowbit/layouts/lut4.py): qweight [N, K/2] uint8, within each run of 32 codes byte j
holds code j (low nibble) and code j+16 (high nibble).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _decode_tile(qw_ptr, s_ptr, mn_ptr, lut_ptr, offs_n, k, N, K, GROUP: tl.constexpr, HAS_MIN: tl.constexpr):
    """fp32 weights [BLOCK_N, BLOCK_K] for rows offs_n and columns k (k % 32 order as in the layout)."""
    mask = (offs_n[:, None] < N) & (k[None, :] < K)
    byte = (k // 32) * 16 + (k % 16)
    shift = ((k % 32) // 16) * 4
    packed = tl.load(qw_ptr + offs_n[:, None] * (K // 2) + byte[None, :], mask=mask, other=0)
    codes = (packed.to(tl.int32) >> shift[None, :]) & 0xF
    w = tl.load(lut_ptr + codes)
    g_off = offs_n[:, None] * (K // GROUP) + (k // GROUP)[None, :]
    w = w * tl.load(s_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_MIN:
        w = w + tl.load(mn_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
    return w


@triton.jit
def _lut4_matmul_kernel(x_ptr, qw_ptr, s_ptr, mn_ptr, lut_ptr, b_ptr, y_ptr, M, N, K,
                        GROUP: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                        DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * K + k[None, :],
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = _decode_tile(qw_ptr, s_ptr, mn_ptr, lut_ptr, offs_n, k, N, K, GROUP, HAS_MIN)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _lut4_dequant_kernel(qw_ptr, s_ptr, mn_ptr, lut_ptr, out_ptr, N, K, GROUP: tl.constexpr,
                         HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    w = _decode_tile(qw_ptr, s_ptr, mn_ptr, lut_ptr, offs_n, k, N, K, GROUP, HAS_MIN)
    tl.store(out_ptr + offs_n[:, None] * K + k[None, :], w, mask=(offs_n[:, None] < N) & (k[None, :] < K))


def _checked(qweight, scales, mins, lut, group_size):
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if k % group_size or group_size % 32:
        raise ValueError(f"lut4 (triton): group size {group_size} must be a multiple of 32 dividing K={k}")
    return n, k, qweight.contiguous(), scales.contiguous(), (mins.contiguous() if mins is not None else scales), lut.contiguous()


def lut4_linear(x, qweight, scales, mins, lut, group_size, bias=None):
    n, k, qw, sc, mn, lt = _checked(qweight, scales, mins, lut, group_size)
    if x.shape[-1] != k:
        raise ValueError(f"lut4_linear (triton): x has {x.shape[-1]} features, weight has K={k}")
    x2 = x.reshape(-1, k).contiguous()
    if _INTERPRET:  # the interpreter mis-handles bf16 loads: hand it fp32
        x2 = x2.float()
        bias = bias.float() if bias is not None else None
    m = x2.shape[0]
    # fp32 output buffer under the interpreter (its bf16 handling is unreliable), x's dtype on GPU.
    y = torch.empty((m, n), device=x.device, dtype=torch.float32 if _INTERPRET else x.dtype)
    if m:
        block_m, block_n, block_k = 16, 64, 64  # GPU-valid tl.dot tiles (M >= 16)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _lut4_matmul_kernel[grid](
            x2, qw, sc, mn, lt, bias if bias is not None else sc, y, m, n, k,
            GROUP=group_size, HAS_MIN=mins is not None, HAS_BIAS=bias is not None,
            DOT_FP32=_INTERPRET or x.dtype == torch.float32,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def lut4_dequantize(qweight, scales, mins, lut, group_size):
    n, k, qw, sc, mn, lt = _checked(qweight, scales, mins, lut, group_size)
    out = torch.empty((n, k), device=qweight.device, dtype=torch.float32)
    block_n, block_k = 32, 64
    _lut4_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qw, sc, mn, lt, out, n, k, GROUP=group_size, HAS_MIN=mins is not None,
        BLOCK_N=block_n, BLOCK_K=block_k)
    return out
