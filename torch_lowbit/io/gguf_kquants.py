"""GGUF K-quant tensors (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) <-> the torch_lowbit K-quant formats, losslessly.

A GGUF tensor of ggml shape [K, N] is N rows of K/256 super-blocks of ggml's block structs; each
row's bytes decode into the format's unpacked tensors (formats/kquants.py) and encode back byte for
byte (the conversion itself is core/kquant_blocks.py, shared with the ggml_k_blocks layout, whose
buffers are these bytes). The format's dequantize() of the tensors equals gguf's dequantizer of the
bytes bit for bit.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..core.kquant_blocks import BLOCK_BYTES, blocks_to_tensors, tensors_to_blocks
from ..formats import Format, get_format
from ..formats.kquants import KQuantFormat

_BY_TYPE = {name.upper(): name for name in BLOCK_BYTES}  # GGUF type name -> format name


def kquant_format(type_name: str) -> Optional[str]:
    """The torch_lowbit format a GGUF K-quant type ("Q4_K", ...) imports into losslessly, or None for
    any other type."""
    return _BY_TYPE.get(type_name)


def kquant_tensors(raw: np.ndarray, type_name: str) -> dict[str, Tensor]:
    """uint8 [N, K/256 * block bytes] of a GGUF K-quant tensor -> the format's tensors (codes,
    sub_scales, d, and sub_mins, dmin for Q2_K / Q4_K / Q5_K), as its quantize() returns them."""
    fmt_name = kquant_format(type_name)
    if fmt_name is None:
        raise ValueError(f"{type_name} is not a K-quant type; K-quant types: {', '.join(_BY_TYPE)}")
    # a copy: file tensors are read-only memory maps, and torch tensors may not alias those
    return blocks_to_tensors(fmt_name, torch.from_numpy(np.array(raw, dtype=np.uint8)))


def kquant_blocks(fmt: "str | Format", q: dict[str, Tensor]) -> np.ndarray:
    """A K-quant format's tensors -> uint8 [N, K/256 * block bytes], the GGUF tensor's bytes (type
    name: fmt.name.upper())."""
    fmt = get_format(fmt)
    if not isinstance(fmt, KQuantFormat):
        raise ValueError(f"format {fmt.name} is not a K-quant; K-quant formats: {', '.join(BLOCK_BYTES)}")
    n, k = q["codes"].shape
    fmt.check_quantized(q, n, k)
    return tensors_to_blocks(fmt.name, {key: t.cpu() for key, t in q.items()}).numpy()
