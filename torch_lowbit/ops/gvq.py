"""The gvq ops (layout gvq_rowmajor, the general VQ formats): gvq_linear / gvq_dequantize over codes
stored as LSB-first bit fields (vector j's stage-r code is field j * stages + r of its row), in chunks
of chunk_fields(2^code_bits) fields stored chunk-major, fp16 codebook planes [regions, stages, vec,
2^code_bits] (one region per tile_rows x tile_cols block of the weight; 0 = all rows / all features)
and fp16 row scales. CPU: csrc/gvq_linear.cpp (the table GEMV, csrc/common/gvq.h), or the layout's
reference decoder and a dense matmul where the extension is absent; CUDA: that reference (no Triton
kernel yet). Typed wrappers, checks, fakes and those impls."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

from ..core.packing import bitfield_bytes
from ._common import Backend, check, dense_linear, linear_out, register_reference_cpu_impl, route


def gvq_linear(x: Tensor, codes: Tensor, code_bits: int, codebooks: Tensor, tile_rows: int, tile_cols: int,
               row_scales: Tensor, bias: Optional[Tensor], *, backend: Backend = "auto") -> Tensor:
    """y = x @ W'.T + bias in x's dtype (x already rotated for rotated formats)."""
    return route("gvq_linear", None, backend, x, codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, bias)


def gvq_dequantize(codes: Tensor, code_bits: int, codebooks: Tensor, tile_rows: int, tile_cols: int,
                   row_scales: Tensor, in_features: int, *, backend: Backend = "auto") -> Tensor:
    """W' fp32 [N, in_features]."""
    return route("gvq_dequantize", None, backend, codes, code_bits, codebooks, tile_rows, tile_cols, row_scales,
                 in_features)


GVQ_KERNELS = ("tables", "direct", "decode")


@contextlib.contextmanager
def gvq_kernel(name: str) -> Iterator[None]:
    """Benchmark hook: gvq_linear's CPU kernel for up to 8 tokens inside the block: "tables" (the
    default: per chunk of fields, L1 tables of every entry's dot product with x), "direct" (every code's
    entry read from the whole codebook and multiplied with x: VQ-LLM's shared-memory baseline) or
    "decode" (rows dequantized to fp32, then at::mm: the element-wise baseline)."""
    from .extension import cpu_extension
    if name not in GVQ_KERNELS:
        raise ValueError(f"gvq kernel must be one of {', '.join(GVQ_KERNELS)}, got {name!r}")
    ext = cpu_extension()
    ext.set_gvq_kernel(name)
    try:
        yield
    finally:
        ext.set_gvq_kernel("tables")


def check_gvq(codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, in_features) -> tuple[int, int]:
    """(N, K) of gvq_rowmajor weights, every argument checked."""
    check(4 <= code_bits <= 16, f"gvq: code_bits must be 4..16, got {code_bits}")
    check(codebooks.dtype == torch.float16 and codebooks.dim() == 4 and codebooks.shape[1] in (1, 2)
          and codebooks.shape[2] in (2, 4, 8) and codebooks.shape[3] == 2 ** code_bits,
          f"gvq: codebooks must be fp16 planes [regions, 1 or 2 stages, vec 2/4/8, {2 ** code_bits}]")
    vec, stages = codebooks.shape[2], codebooks.shape[1]
    check(in_features % vec == 0, f"gvq: in_features {in_features} is not a multiple of the vector size {vec}")
    check(tile_rows >= 0 and tile_cols >= 0 and tile_cols % vec == 0,
          f"gvq: tile_rows / tile_cols must be >= 0 and tile_cols a multiple of {vec}")
    check(row_scales.dtype == torch.float16 and row_scales.dim() == 1, "gvq: row_scales must be fp16 [N]")
    n = row_scales.shape[0]
    nbytes = bitfield_bytes(in_features // vec * stages, code_bits)
    check(codes.dtype == torch.uint8 and tuple(codes.shape) == (n, nbytes),
          f"gvq: codes must be uint8 [{n}, {nbytes}] (bit fields of {in_features // vec * stages} codes per row)")
    row_tiles = -(-n // tile_rows) if tile_rows else 1
    col_tiles = -(-in_features // tile_cols) if tile_cols else 1
    check(codebooks.shape[0] == row_tiles * col_tiles,
          f"gvq: {row_tiles * col_tiles} codebook regions expected for a {n}x{in_features} weight with tiles "
          f"{tile_rows}x{tile_cols}, got {codebooks.shape[0]}")
    return n, in_features


@torch.library.register_fake("torch_lowbit::gvq_linear")
def _gvq_linear_fake(x, codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, bias):
    n, k = check_gvq(codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, x.shape[-1])
    return linear_out("gvq_linear", x, n, k, bias)


@torch.library.register_fake("torch_lowbit::gvq_dequantize")
def _gvq_dequantize_fake(codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, in_features):
    n, k = check_gvq(codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, in_features)
    return codes.new_empty((n, k), dtype=torch.float32)


def register_reference_impls(decode: Callable) -> None:
    """The CUDA impls, and the CPU ones where the extension is absent: decode(codes, code_bits,
    codebooks, tile_rows, tile_cols, row_scales, in_features) -> fp32 W' [N, K] (the format's reference
    decoder, from layouts/gvq.py) and a dense fp32 matmul."""
    def dequantize(codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, in_features):
        check_gvq(codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, in_features)
        return decode(codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, in_features)

    def linear(x, codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, bias):
        w = dequantize(codes, code_bits, codebooks, tile_rows, tile_cols, row_scales, x.shape[-1])
        linear_out("gvq_linear", x, w.shape[0], w.shape[1], bias)
        return dense_linear(x, w, bias)

    torch.library.impl("torch_lowbit::gvq_dequantize", "CUDA")(dequantize)
    torch.library.impl("torch_lowbit::gvq_linear", "CUDA")(linear)
    register_reference_cpu_impl("gvq_dequantize", dequantize)
    register_reference_cpu_impl("gvq_linear", linear)
