"""GGUF block bytes <-> torch_lowbit format tensors, without requantizing, and llama.cpp's q/k row order.

A GGUF tensor of ggml shape [K, N] is stored as N rows of K/32 blocks; each block is the same
fp16 scale (and min) plus 32 codes that the matching torch_lowbit format stores, so a block decodes
into that format's quantize() output ({"codes": uint8 [N, K], "scales": fp16 [N, K/32] (, "mins")})
and encodes back byte for byte:

| GGUF   | block bytes                     | format    | value                       |
|--------|---------------------------------|-----------|-----------------------------|
| Q4_0   | fp16 d, 16 B nibbles            | q4_0      | (code - 8) * d              |
| Q4_1   | fp16 d, fp16 m, 16 B nibbles    | int4_g32  | code * d + m                |
| IQ4_NL | fp16 d, 16 B nibbles            | iq4_nl    | kvalues_iq4nl[code] * d     |
| Q8_0   | fp16 d, 32 int8 q               | q8_0      | (code - 128) * d, code = q + 128 |
| Q5_0   | fp16 d, u32 qh, 16 B nibbles    | q5_0      | (code - 16) * d             |
| Q5_1   | fp16 d, fp16 m, u32 qh, 16 B nibbles | q5_1 | code * d + m                |

Nibbles are in ggml's half-split order (low nibbles = codes 0..15 of the block, high = 16..31),
which is torch_lowbit.core.packing's pack_nibbles order. Q5's nibbles are a code's low 4 bits and
bit j of the little-endian qh its bit 4.

A type imports as blocks where its format is registered and has a CPU kernel layout (native_format):
all of these (Q5_0 / Q5_1 in the lut5_i8_n16 tiles).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..formats import Format, get_format
from ..formats.registry import formats
from ..formats.uniform import GGML_Q5, IntAsym
from ..core.packing import pack_nibbles, row_bytes_codes
from ..layouts.base import default_layout
from .gguf_kquants import kquant_blocks, kquant_format

BLOCK = 32  # weights per block of every type handled here

# GGUF type name -> (torch_lowbit format name, block bytes, bytes before the codes)
NATIVE = {"Q4_0": ("q4_0", 18, 2), "Q4_1": ("int4_g32", 20, 4), "IQ4_NL": ("iq4_nl", 18, 2),
          "Q8_0": ("q8_0", 34, 2), "Q5_0": ("q5_0", 22, 6), "Q5_1": ("q5_1", 24, 8)}
HAS_MINS = ("Q4_1", "Q5_1")  # fp16 m after fp16 d
FIVE_BIT = ("Q5_0", "Q5_1")  # u32 qh (bit 4 of each code) before the nibbles


def native_format(type_name: str) -> Optional[str]:
    """The registered torch_lowbit format a GGUF type imports into losslessly, or None (q8_0 only once
    that format is registered)."""
    entry = NATIVE.get(type_name)
    if entry is None or entry[0] not in formats():
        return None
    try:
        default_layout(get_format(entry[0]), "cpu")
    except ValueError:
        return None  # no kernel layout holds its codes: the importer dequantizes it
    return entry[0]


def codes_as_row_bytes(type_name: str) -> bool:
    """Whether block_tensors gives this type's codes as row bytes (4- and 8-bit payloads) rather than
    one code per byte (Q5: the nibbles and qh bits recombined)."""
    return type_name not in FIVE_BIT


def gguf_type_for(fmt: Format) -> Optional[str]:
    """The GGUF type whose blocks hold this format's values exactly, or None. 4-bit asymmetric formats
    of any group size 32k are Q4_1 (a group of 64 is two blocks with the same d and m)."""
    by_name = {"q4_0": "Q4_0", "iq4_nl": "IQ4_NL", "q8_0": "Q8_0", "q5_0": "Q5_0", "q5_1": "Q5_1"}
    if fmt.name in by_name:
        return by_name[fmt.name]
    if kquant_format(fmt.name.upper()) == fmt.name:  # q2_k .. q6_k: their own GGUF types
        return fmt.name.upper()
    if isinstance(fmt, IntAsym) and fmt.bits == 4 and fmt.group % BLOCK == 0:
        return "Q4_1"
    return None


def _fp16_column(blocks: np.ndarray, offset: int) -> Tensor:
    """fp16 [N, blocks] from bytes offset..offset+2 of every block (a bit-exact copy)."""
    raw = np.ascontiguousarray(blocks[:, :, offset:offset + 2])
    return torch.from_numpy(raw.view(np.float16)[..., 0].copy())


def block_tensors(raw: np.ndarray, type_name: str) -> dict[str, Tensor]:
    """uint8 [N, K/32 * block bytes] of a GGUF tensor -> the format's scales (/ mins) and its codes as
    row bytes (core.packing.row_bytes: Q4_0 / Q4_1 / IQ4_NL the payload as stored, Q8_0 q + 128), which
    QuantLinear.from_quantized(codes_as_row_bytes=True) packs without unpacking them; Q5_0 / Q5_1 codes
    one per byte (codes_as_row_bytes(type_name) is False)."""
    fmt_name, nbytes, head = NATIVE[type_name]
    raw = np.asarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"GGUF {type_name} rows must be whole {nbytes}-byte blocks of {BLOCK} weights; got "
                         f"row bytes {tuple(raw.shape[1:])} (the row length must be a multiple of {BLOCK})")
    blocks = raw.reshape(rows, -1, nbytes)
    payload = torch.from_numpy(np.array(blocks[:, :, head:]).reshape(rows, -1))
    if type_name == "Q8_0":
        payload ^= 0x80  # int8 q -> the code q + 128
    if type_name in FIVE_BIT:
        qh = np.ascontiguousarray(blocks[:, :, head - 4:head]).view("<u4")  # [N, blocks, 1]
        high = torch.from_numpy(((qh >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.uint8))
        payload = row_bytes_codes(payload, 4) | (high.reshape(rows, -1) << 4)
    q = {"codes": payload, "scales": _fp16_column(blocks, 0)}
    if type_name in HAS_MINS:
        q["mins"] = _fp16_column(blocks, 2)
    return q


def decode_blocks(raw: np.ndarray, type_name: str) -> dict[str, Tensor]:
    """uint8 [N, K/32 * block bytes] of a GGUF tensor -> the format's codes / scales (/ mins)."""
    q = block_tensors(raw, type_name)
    if not codes_as_row_bytes(type_name):
        return q
    return {**q, "codes": row_bytes_codes(q["codes"], format_of(type_name).code_bits)}


def encode_blocks(fmt: Format, q: dict[str, Tensor]) -> tuple[str, np.ndarray]:
    """A format's codes / scales (/ mins) -> (GGUF type name, uint8 [N, K/32 * block bytes])."""
    type_name = gguf_type_for(fmt)
    if type_name is None:
        raise ValueError(f"format {fmt.name} has no GGUF block type")
    if kquant_format(type_name) is not None:
        return type_name, kquant_blocks(fmt, q)
    codes = q["codes"].to(torch.uint8)
    rows, k = codes.shape
    if k % BLOCK:
        raise ValueError(f"GGUF {type_name} needs rows of whole {BLOCK}-weight blocks; got row length {k}")
    repeat = fmt.group_size // BLOCK  # int4_g64/g128: each group's d, m serve 2/4 blocks

    def per_block(t: Tensor) -> np.ndarray:
        t = t.to(torch.float16).repeat_interleave(repeat, dim=1) if repeat > 1 else t.to(torch.float16)
        return t.contiguous().numpy().view(np.uint8).reshape(rows, k // BLOCK, 2)

    parts = [per_block(q["scales"])]
    if type_name in HAS_MINS:
        parts.append(per_block(q["mins"]))
    if type_name in FIVE_BIT:
        bit4 = (codes >> 4).to(torch.int64).reshape(rows, k // BLOCK, BLOCK)
        qh = (bit4 << torch.arange(BLOCK)).sum(-1).to(torch.int64).numpy().astype("<u4")
        parts.append(qh.view(np.uint8).reshape(rows, k // BLOCK, 4))
        codes = codes & 15
    if type_name == "Q8_0":
        payload = (codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
    else:
        payload = pack_nibbles(codes)
    parts.append(payload.numpy().reshape(rows, k // BLOCK, -1))
    return type_name, np.concatenate(parts, axis=-1).reshape(rows, -1)


def format_of(type_name: str) -> Format:
    name = NATIVE[type_name][0]
    return GGML_Q5[name] if name in GGML_Q5 else get_format(name)


# ---- llama.cpp's rope row order for q/k projections ---------------------------------------------

def rope_rows(rows: int, n_head: int, *, to_gguf: bool) -> Tensor:
    """Row indices of llama.cpp's q/k permutation (convert_hf_to_gguf.py LlamaModel.permute): HF keeps
    each head's rotary halves apart, llama.cpp interleaves them. to_gguf: gguf = hf[idx]; else
    hf = gguf[idx]. Rows are whole: permuting codes, scales and mins rows is lossless."""
    if rows % (2 * n_head):
        raise ValueError(f"{rows} q/k rows do not split into {n_head} heads of rotary pairs")
    half = rows // n_head // 2
    idx = torch.arange(rows)
    if to_gguf:
        return idx.reshape(n_head, 2, half).transpose(1, 2).reshape(-1)
    return idx.reshape(n_head, half, 2).transpose(1, 2).reshape(-1)
