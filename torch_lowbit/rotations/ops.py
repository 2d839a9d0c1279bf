"""torch_lowbit::hadamard_transform(Tensor x, Tensor? signs, bool inverse) -> Tensor.

Schema: torch_lowbit/ops/schemas.py; CPU kernel: csrc/hadamard.cpp. Here: the base matrices handed to
the C++ registry (the tables stay in _base_matrices.py only), the fake implementation (shapes and
validation for torch.compile and meta tensors), the CUDA implementation (fast_hadamard_transform for
the 2^m part when that package is installed, else the Triton kernel) and, where the extension is
absent, the dense reference as the CPU implementation.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ..ops import cpu_extension, has_cpu_extension
from ..ops._common import register_reference_cpu_impl, route
from ..ops.backend import current_backend
from .hadamard import (SUPPORTED_BASE_ORDERS, base_hadamard_matrix, base_order, check_hadamard_size,
                       hadamard_transform_reference)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_inputs(x: torch.Tensor, signs: Optional[torch.Tensor]) -> None:
    torch._check(x.dtype in _FLOAT_DTYPES, lambda: f"hadamard_transform: x must be fp32, bf16 or fp16, got {x.dtype}")
    torch._check(x.dim() >= 1, lambda: "hadamard_transform: x must have at least one dimension")
    n = int(x.shape[-1])  # the rotated dim is a model width: static
    check_hadamard_size(n)
    if signs is not None:
        torch._check(signs.dim() == 1 and signs.shape[0] == n,
                     lambda: f"hadamard_transform: signs must be a 1-D tensor of {n} values, got {tuple(signs.shape)}")
        torch._check(signs.dtype == torch.float32, lambda: f"hadamard_transform: signs must be fp32, got {signs.dtype}")


@functools.lru_cache(maxsize=None)
def _fast_hadamard_transform():
    """fast_hadamard_transform.hadamard_transform(x, scale) if that optional CUDA-only package is
    installed (looked up once: a failed import would otherwise rescan sys.path on every call)."""
    try:
        from fast_hadamard_transform import hadamard_transform
    except ImportError:
        return None
    return hadamard_transform


def _cuda_with_fast_hadamard_transform(fht, x: torch.Tensor, signs: Optional[torch.Tensor],
                                       inverse: bool) -> torch.Tensor:
    """fast_hadamard_transform (CUDA-only package) for the 2^m blocks, a batched matmul for the base mix."""
    n = x.shape[-1]
    k = base_order(n)
    xf = x.reshape(-1, n).float()
    if signs is not None and not inverse:
        xf = xf * signs
    t = fht(xf.reshape(-1, k, n // k).contiguous(), 1.0 / math.sqrt(n))  # along the last dim: each block
    if k > 1:
        h = base_hadamard_matrix(k).to(x.device)
        t = torch.matmul(h if inverse else h.T, t)  # out block c = sum_a mix[c, a] * block a
    y = t.reshape(-1, n)
    if signs is not None and inverse:
        y = y * signs
    return y.reshape(x.shape).to(x.dtype)


def _hadamard_transform_cpu_reference(x, signs, inverse):
    _check_inputs(x, signs)
    return hadamard_transform_reference(x, signs, inverse)


def _register() -> None:
    if has_cpu_extension():  # the C++ kernel's base matrices, checked there as they arrive
        for k in SUPPORTED_BASE_ORDERS:
            if k > 1:
                cpu_extension().register_hadamard_base(base_hadamard_matrix(k))
    register_reference_cpu_impl("hadamard_transform", _hadamard_transform_cpu_reference)

    @torch.library.register_fake("torch_lowbit::hadamard_transform")
    def _hadamard_transform_fake(x, signs, inverse):
        _check_inputs(x, signs)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @torch.library.impl("torch_lowbit::hadamard_transform", "CUDA")
    def _hadamard_transform_cuda(x, signs, inverse):
        _check_inputs(x, signs)
        fht = _fast_hadamard_transform()
        if fht is not None and x.shape[-1] // base_order(x.shape[-1]) >= 8:  # its kernels pad tiny dims
            return _cuda_with_fast_hadamard_transform(fht, x, signs, inverse)
        from ..triton_kernels.hadamard import hadamard_transform as triton_hadamard_transform
        return triton_hadamard_transform(x, signs, inverse)

    # The transform is orthogonal, and `inverse` is its inverse ((x s) H vs (x H^T) s): the gradient of
    # one is the other applied to the output's gradient (training through online rotations, e.g.
    # learn_rotation_; without this autograd would stop at the op).
    def _setup_context(ctx, inputs, output):
        _, signs, inverse = inputs
        ctx.save_for_backward(signs)
        ctx.inverse = inverse

    def _backward(ctx, grad):
        (signs,) = ctx.saved_tensors
        return torch.ops.torch_lowbit.hadamard_transform(grad.contiguous(), signs, not ctx.inverse), None, None

    torch.library.register_autograd("torch_lowbit::hadamard_transform", _backward, setup_context=_setup_context)


_register()


def hadamard_transform(x: torch.Tensor, signs: Optional[torch.Tensor] = None, inverse: bool = False, *,
                       backend: Optional[str] = None) -> torch.Tensor:
    """Randomized Hadamard transform along the last dim (formulas: torch_lowbit/rotations/hadamard.py).

    CPU and CUDA tensors run the custom op torch.ops.torch_lowbit.hadamard_transform (fast
    Walsh-Hadamard butterflies plus the k x k base mix); use_backend("reference") forces the dense
    fp32 product. Output dtype = input dtype; arithmetic in fp32. backend: as a layout's op calls
    (ops._common.route), "triton" on CPU tensors runs the Triton kernel (the interpreter route).
    """
    if x.dim() == 0:
        raise ValueError("hadamard_transform: x must have at least one dimension (the rotated one is the last)")
    check_hadamard_size(x.shape[-1])  # ValueError naming the nearest supported sizes
    if backend is None:
        if current_backend() == "reference" or x.device.type not in ("cpu", "cuda", "meta"):
            return hadamard_transform_reference(x, signs, inverse)
        backend = "auto"
    return route("hadamard_transform", "hadamard", backend, x, signs, inverse)
