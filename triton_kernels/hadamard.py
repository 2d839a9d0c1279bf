"""Randomized Hadamard transform y = (x * s) @ H_n (forward) or (x @ H_n^T) * s (inverse), with
H_n = (H_k ⊗ H_len) / sqrt(n), n = k * len, len = 2^m (see torch_lowbit/rotations/hadamard.py).

One program per (block of rows, output block c). The two Kronecker factors commute, so a program
first mixes the k input blocks of its rows into block c (out_c = sum_a mix[c, a] * x_a, the base
part, a few input blocks per step) and then runs the Walsh-Hadamard butterflies of that block in
registers: each stage reshapes the tile so butterfly partners (offset h) sit in a dimension of size
2, splits, adds/subtracts, joins. The live tiles stay bounded whatever k is; the price is that each
of the k programs of a row block reads the whole row (from L2 after the first).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .matmul import cdiv, next_power_of_2

_TILE_VALUES = 4096  # rows per program: enough for a [BLOCK_M, len] tile of this many values
_LOAD_VALUES = 8192  # input blocks per mix step: a [BLOCK_M, A_CHUNK, len] load of at most this many


@triton.jit
def _hadamard_kernel(x_ptr, signs_ptr, mix_ptr, y_ptr, rows, scale,
                     K: tl.constexpr, LEN: tl.constexpr, LOG_LEN: tl.constexpr, HAS_SIGNS: tl.constexpr,
                     INVERSE: tl.constexpr, BLOCK_M: tl.constexpr, A_CHUNK: tl.constexpr):
    pid_m = tl.program_id(0)
    c = tl.program_id(1)
    N: tl.constexpr = K * LEN
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, LEN)
    row_mask = offs_m[:, None] < rows
    row_base = offs_m[:, None].to(tl.int64) * N

    # base mix, A_CHUNK input blocks per step: acc = sum_a mix[c, a] * x[:, a, :]
    acc = tl.zeros((BLOCK_M, LEN), dtype=tl.float32)
    offs_a = tl.arange(0, A_CHUNK)
    for a0 in range(0, K, A_CHUNK):
        a = a0 + offs_a
        a_mask = a < K
        cols = a[:, None] * LEN + offs_j[None, :]  # [A_CHUNK, LEN]
        v = tl.load(x_ptr + row_base[:, :, None] + cols[None, :, :],
                    mask=row_mask[:, :, None] & a_mask[None, :, None], other=0.0).to(tl.float32)
        if HAS_SIGNS and not INVERSE:
            v = v * tl.load(signs_ptr + cols, mask=a_mask[:, None], other=0.0)[None, :, :]
        m = tl.load(mix_ptr + c * K + a, mask=a_mask, other=0.0)
        acc += tl.sum(v * m[None, :, None], axis=1)

    for stage in tl.static_range(LOG_LEN):  # butterflies of span 1 << stage (a constexpr cannot be reassigned)
        pairs = tl.permute(tl.reshape(acc, (BLOCK_M, LEN // (2 << stage), 2, 1 << stage)), (0, 1, 3, 2))
        lo, hi = tl.split(pairs)
        acc = tl.reshape(tl.permute(tl.join(lo + hi, lo - hi), (0, 1, 3, 2)), (BLOCK_M, LEN))

    out_cols = c * LEN + offs_j
    acc = acc * scale
    if HAS_SIGNS and INVERSE:
        acc = acc * tl.load(signs_ptr + out_cols)[None, :]
    tl.store(y_ptr + row_base + out_cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=row_mask)


_MIX_CACHE: dict = {}


def _block_mix(k: int, inverse: bool, device: torch.device) -> torch.Tensor:
    """mix[c, a]: H_k^T for the forward transform, H_k for the inverse (fp32, on device)."""
    key = (k, inverse, str(device))
    if key not in _MIX_CACHE:
        from torch_lowbit.rotations.hadamard import base_hadamard_matrix
        h = base_hadamard_matrix(k)
        _MIX_CACHE[key] = (h if inverse else h.T).contiguous().to(device)
    return _MIX_CACHE[key]


def hadamard_transform(x: torch.Tensor, signs: Optional[torch.Tensor] = None, inverse: bool = False) -> torch.Tensor:
    from torch_lowbit.rotations.hadamard import check_hadamard_size

    n = x.shape[-1]
    k = check_hadamard_size(n)
    length = n // k
    xc = x.contiguous()
    y = torch.empty_like(xc)
    rows = xc.numel() // n
    if rows == 0:
        return y
    s = signs.to(device=x.device, dtype=torch.float32).contiguous() if signs is not None else None
    block_m = max(1, min(next_power_of_2(rows), _TILE_VALUES // length))
    a_chunk = min(next_power_of_2(k), max(1, _LOAD_VALUES // (block_m * length)))
    grid = (cdiv(rows, block_m), k)
    _hadamard_kernel[grid](xc, s if s is not None else xc, _block_mix(k, inverse, x.device), y, rows,
                           1.0 / math.sqrt(n), K=k, LEN=length, LOG_LEN=length.bit_length() - 1,
                           HAS_SIGNS=s is not None, INVERSE=inverse, BLOCK_M=block_m, A_CHUNK=a_chunk,
                           num_warps=4 if length * block_m <= 2048 else 8)
    return y
