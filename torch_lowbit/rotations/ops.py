"""torch_lowbit::hadamard_transform(Tensor x, Tensor? signs, bool inverse) -> Tensor.

Schema and CPU kernel: csrc/hadamard.cpp. Here: the base matrices handed to the C++ registry (the
tables stay in _base_matrices.py only), the fake implementation (shapes and validation for
torch.compile and meta tensors).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.library import cpu_extension
from .hadamard import SUPPORTED_BASE_ORDERS, base_hadamard_matrix, check_hadamard_size

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


def _register() -> None:
    cpu_extension()  # loads the schema and the CPU kernel
    for k in SUPPORTED_BASE_ORDERS:
        if k > 1:
            torch.ops.torch_lowbit._hadamard_register_base(base_hadamard_matrix(k))

    @torch.library.register_fake("torch_lowbit::hadamard_transform")
    def _hadamard_transform_fake(x, signs, inverse):
        _check_inputs(x, signs)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_register()
