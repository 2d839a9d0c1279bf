"""Randomized Hadamard transforms for incoherence processing (QuaRot / QuIP# style rotations).

Sizes: n = k * 2^m with k in SUPPORTED_BASE_ORDERS (k = 1: pure powers of two). The normalized
matrix is the Kronecker product

    H_n = (H_k ⊗ H_{2^m}) / sqrt(n),     H_{2^m} the Sylvester matrix ([[1, 1], [1, -1]] ⊗ ...),

so H_n H_n^T = I. Element i of a vector belongs to block i // 2^m (of k contiguous blocks) at offset
i % 2^m. When two base orders fit n (40 * 2^m == 20 * 2^(m+1)) the larger k is used, as QuaRot does.

Convention along the last dimension, with s an optional +-1 vector of length n:
    forward:  y = (x * s) @ H_n
    inverse:  y = (x @ H_n^T) * s          so inverse(forward(x)) == x.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ._base_matrices import BASE_HADAMARD_HEX

SUPPORTED_BASE_ORDERS: tuple[int, ...] = (1, *sorted(BASE_HADAMARD_HEX))


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def base_order(n: int) -> Optional[int]:
    """The base order k with n = k * 2^m (the largest such k), or None if n is unsupported."""
    if not isinstance(n, int) or n <= 0:
        return None
    for k in sorted(SUPPORTED_BASE_ORDERS, reverse=True):
        if n % k == 0 and _is_power_of_two(n // k):
            return k
    return None


def supported_hadamard_size(n: int) -> bool:
    return base_order(n) is not None


def _nearest_supported(n: int) -> tuple[Optional[int], Optional[int]]:
    """The largest supported size below n and the smallest above it."""
    candidates = set()
    for k in SUPPORTED_BASE_ORDERS:
        p = 1
        while k * p <= 2 * n:
            candidates.add(k * p)
            p *= 2
        candidates.add(k * p)
    below = max((c for c in candidates if c < n), default=None)
    above = min(c for c in candidates if c > n)
    return below, above


def check_hadamard_size(n: int) -> int:
    """Returns the base order k of n, or raises ValueError naming the supported forms."""
    k = base_order(n)
    if k is None:
        below, above = _nearest_supported(n) if isinstance(n, int) and n > 0 else (None, 1)
        nearest = " or ".join(str(s) for s in (below, above) if s is not None)
        raise ValueError(f"no Hadamard transform of size {n}: supported sizes are k * 2^m with k in "
                         f"{list(SUPPORTED_BASE_ORDERS)}; nearest supported: {nearest}")
    return k


@functools.lru_cache(maxsize=None)
def _base_matrix_cached(k: int) -> torch.Tensor:
    rows = BASE_HADAMARD_HEX[k]
    bits = [[(int(row, 16) >> (k - 1 - j)) & 1 for j in range(k)] for row in rows]
    return 1.0 - 2.0 * torch.tensor(bits, dtype=torch.float32)


def base_hadamard_matrix(k: int) -> torch.Tensor:
    """The unnormalized k x k base matrix (entries +-1, H H^T = k I); k = 1 gives [[1.]]."""
    if k == 1:
        return torch.ones(1, 1)
    if k not in BASE_HADAMARD_HEX:
        raise ValueError(f"no base Hadamard matrix of order {k}; have {list(SUPPORTED_BASE_ORDERS)}")
    return _base_matrix_cached(k).clone()


def _sylvester(p: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalized n x n matrix H_n = (H_k ⊗ H_{2^m}) / sqrt(n); orthogonal."""
    k = check_hadamard_size(n)
    # +-1 entries are exact in fp32; float64 only when asked for (n = 2^14 is 1 GiB in fp32)
    build = torch.float64 if dtype == torch.float64 else torch.float32
    h = torch.kron(base_hadamard_matrix(k).to(build), _sylvester(n // k).to(build))
    return h.mul_(1 / math.sqrt(n)).to(dtype)


def random_signs(n: int, seed: int) -> torch.Tensor:
    """n random +-1 values (fp32), the same on every machine for a given seed (CPU generator)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float32).mul_(2).sub_(1)


def _check_signs(signs: Optional[torch.Tensor], n: int) -> None:
    if signs is None:
        return
    if signs.dim() != 1 or signs.shape[0] != n:
        raise ValueError(f"hadamard_transform: signs must be a 1-D tensor of {n} values, got shape "
                         f"{tuple(signs.shape)}")
    if not signs.dtype.is_floating_point:
        raise ValueError(f"hadamard_transform: signs must be floating point (+-1), got {signs.dtype}")


def hadamard_transform_reference(x: torch.Tensor, signs: Optional[torch.Tensor] = None,
                                 inverse: bool = False) -> torch.Tensor:
    """The explicit dense product in fp32 (what every kernel is tested against)."""
    n = x.shape[-1]
    check_hadamard_size(n)
    _check_signs(signs, n)
    h = hadamard_matrix(n).to(x.device)
    xf = x.float()
    s = signs.to(device=x.device, dtype=torch.float32) if signs is not None else None
    if inverse:
        y = xf @ h.T
        if s is not None:
            y = y * s
    else:
        y = (xf * s if s is not None else xf) @ h
    return y.to(x.dtype)
