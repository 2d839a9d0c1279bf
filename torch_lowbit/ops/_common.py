"""What every op family module (ops/<family>.py) shares: the argument checks their fake impls make,
the generic registrations (fakes of a <name>_linear / <name>_dequantize pair, dense reference CPU
impls, Triton CUDA impls) and `route`, the one path from a typed wrapper to a kernel.

Importing this module defines the op table (every schema, ops/schemas.py) and loads the C++ CPU kernels
when the extension is there; the family modules then register their Python impls on it, and, where the
extension is absent, the pure-torch references of the ops that have a C++ kernel
(register_reference_cpu_impl).
"""
from __future__ import annotations

import importlib
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor

from ..core.activations import ACT_BITS, KERNEL_ACT_BLOCKS, SUB_BLOCKS
from .extension import has_cpu_extension, warn_reference_cpu_kernels
from .schemas import CPU_KERNEL_OPS

has_cpu_extension()  # loads the C++ kernels (after the op table: ops/extension.py imports it first)

FLOAT_ACTS = (torch.float32, torch.bfloat16, torch.float16)


def check(cond: bool, msg: str) -> None:
    torch._check(cond, lambda: msg)


def linear_out(op: str, x: Tensor, n: int, k: int, bias: Optional[Tensor]) -> Tensor:
    """The checks every fused linear op makes on its activations and bias; its (fake) output."""
    check(x.dtype in FLOAT_ACTS, f"{op}: x must be fp32/bf16/fp16, got {x.dtype}")
    check(x.shape[-1] == k, f"{op}: x has {x.shape[-1]} features, weight has K={k}")
    if bias is not None:
        check(bias.dim() == 1 and bias.shape[0] == n, f"{op}: bias must have {n} elements")
    return x.new_empty((*x.shape[:-1], n))


def check_act_args(op: str, act_bits: int, act_block: int) -> None:
    """The integer-activation arguments of the int8 kernels (act_bits 0: their own q8 blocks)."""
    check(act_bits == 0 or act_bits in ACT_BITS, f"{op}: act_bits must be 0, 8, 4, 3 or 2, got {act_bits}")
    check(act_block == 0 or (act_block in KERNEL_ACT_BLOCKS and act_bits != 0),
          f"{op}: act_block must be 0 (one scale per token) or one of {KERNEL_ACT_BLOCKS} (with act_bits), "
          f"got {act_block}")
    check(act_block not in SUB_BLOCKS or act_bits <= 4,
          f"{op}: act_block {act_block} needs act_bits <= 4, got {act_bits}: use act_block 32 or 0")


def check_stream(op: str, codes: Tensor, code_bits: int, n: int, k: int) -> None:
    """Codes as one MSB-first code_bits-bit stream per row (core.packing.pack_stream)."""
    words = -(-k * code_bits // 32)
    check(codes.dtype == torch.int32 and tuple(codes.shape) == (n, words),
          f"{op}: codes must be int32 [{n}, {words}] (one {code_bits}-bit MSB-first stream per row)")


def register_linear_fakes(name: str, check_weights: Callable) -> None:
    """Fake impls of <name>_linear(x, *weights, bias) and <name>_dequantize(*weights) -> fp32 [N, K],
    where check_weights(*weights) validates the weights and returns (N, K)."""
    def linear_fake(x, *args):
        *weights, bias = args
        return linear_out(f"{name}_linear", x, *check_weights(*weights), bias)

    def dequantize_fake(*weights):
        return weights[0].new_empty(check_weights(*weights), dtype=torch.float32)

    torch.library.register_fake(f"torch_lowbit::{name}_linear")(linear_fake)
    torch.library.register_fake(f"torch_lowbit::{name}_dequantize")(dequantize_fake)


def dense_linear(x: Tensor, w: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x @ w.T + bias in fp32 (the decoded fp32 weight w), returned in x's dtype: the matmul of the CPU
    references, as the C++ kernels accumulate in fp32."""
    return torch.nn.functional.linear(x.float(), w, bias.float() if bias is not None else None).to(x.dtype)


def register_reference_cpu_impl(op: str, reference: Callable) -> None:
    """The CPU impl of torch_lowbit::<op>, an op with a C++ kernel, where the extension is absent: the
    pure-torch `reference` behind a one-time warning (warn_reference_cpu_kernels). Nothing where the
    extension is loaded: its kernel is the CPU impl."""
    if op not in CPU_KERNEL_OPS:
        raise ValueError(f"torch_lowbit::{op} has no C++ kernel to stand in for; register its CPU impl directly")
    if has_cpu_extension():
        return

    def impl(*args):
        warn_reference_cpu_kernels()
        return reference(*args)
    impl.__name__ = f"_{op}_cpu_reference"
    torch.library.impl(f"torch_lowbit::{op}", "CPU")(impl)


def register_dense_cpu_impls(name: str, check_weights: Callable, decode: Callable) -> None:
    """CPU impls of <name>_dequantize / <name>_linear: the weights checked, then decode(in_features,
    *weights) -> fp32 [N, K] (the format's reference decoder, handed in by the layout that owns the op,
    so this layer imports no format) and a dense float matmul. For ops with no C++ kernel the impls; for
    ops with one (lut4, codebook, tcq) the references that stand in where the extension is absent."""
    def dequantize_cpu(*weights):
        _, k = check_weights(*weights)
        return decode(k, *weights)

    def linear_cpu(x, *args):
        *weights, bias = args
        w = dequantize_cpu(*weights)
        linear_out(f"{name}_linear", x, w.shape[0], w.shape[1], bias)
        return dense_linear(x, w, bias)

    for op, impl in ((f"{name}_dequantize", dequantize_cpu), (f"{name}_linear", linear_cpu)):
        if op in CPU_KERNEL_OPS:
            register_reference_cpu_impl(op, impl)
        else:
            torch.library.impl(f"torch_lowbit::{op}", "CPU")(impl)


def triton_function(kernels: str, name: str) -> Callable:
    """The function `name` of triton_kernels/<kernels>.py (imported on demand: Triton loads only where
    a kernel runs)."""
    return getattr(importlib.import_module(f"..triton_kernels.{kernels}", __package__), name)


def register_triton_cuda(kernels: str, *names: str) -> None:
    """The CUDA impl of each op in `names`: the same-named function of triton_kernels/<kernels>.py."""
    for name in names:
        torch.library.impl(f"torch_lowbit::{name}", "CUDA")(_triton_cuda(kernels, name))


def _triton_cuda(kernels: str, name: str) -> Callable:
    """Looks the Triton function up on the first call and keeps it: a decode step calls these hundreds
    of times, and the import machinery costs µs each time."""
    fn = []

    def impl(*args):
        if not fn:
            fn.append(triton_function(kernels, name))
        return fn[0](*args)
    impl.__name__ = f"_{name}_cuda"
    return impl


# A typed wrapper's `backend`: a kernel backend (ops.backend.BACKENDS; "triton" on CPU tensors runs the
# Triton function itself), or OpCall: no call, the OpCall (see route).
Backend = Union[str, type]


class OpCall(NamedTuple):
    """A call of torch_lowbit::<op>(*args) not made, with the Triton module of its CUDA impl (None:
    a CPU-only op): what a typed wrapper returns for backend=OpCall (Layout.op_call, for the benchmarks
    and tools that call the Triton function with options of their own)."""
    op: str
    kernels: Optional[str]
    args: tuple


def route(op: str, kernels: Optional[str], backend: Backend, *args):
    """The one route from a typed wrapper to a kernel: torch.ops.torch_lowbit.<op>(*args) (its CPU or
    CUDA impl by the tensors' device, its fake impl under compile); with backend "triton" on CPU tensors
    the same-named function of triton_kernels/<kernels>.py (the eager-only debugging route: the kernel
    under TRITON_INTERPRET=1, where torch.ops would run the CPU impl; kernels None: a CPU-only op);
    backend OpCall: no call, the OpCall. args[0] is the activations (their device decides)."""
    if backend is OpCall:
        return OpCall(op, kernels, args)
    if backend == "triton" and args[0].device.type == "cpu":
        if kernels is None:
            raise RuntimeError(f"torch_lowbit::{op} has no Triton kernel; repack the module to a layout the "
                               "triton backend reads")
        return triton_function(kernels, op)(*args)
    return getattr(torch.ops.torch_lowbit, op)(*args)
