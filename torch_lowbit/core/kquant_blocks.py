"""GGUF K-quant super-block bytes <-> the K-quant formats' unpacked tensors, in torch (any device).

A row of K weights is K/256 super-blocks, each stored as ggml's block struct (ggml-common.h):

| type | bytes | struct, in order                                             |
|------|-------|--------------------------------------------------------------|
| q2_k |  84   | scales[16] (scale | min << 4), qs[64] (2-bit), fp16 d, dmin  |
| q3_k | 110   | hmask[32] (high bit), qs[64] (low 2 bits), scales[12], fp16 d |
| q4_k | 144   | fp16 d, dmin, scales[12] (6-bit scales and mins), qs[128]    |
| q5_k | 176   | fp16 d, dmin, scales[12], qh[32] (high bit), qs[128]         |
| q6_k | 210   | ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], fp16 d |

Every bit of every struct is a field, so bytes -> tensors -> bytes is the identity for any bytes
(fp16 fields are copied as bits). The tensors are those the formats in formats/kquants.py hold:
codes uint8 [N, K] one per byte, sub-block scales (and mins) [N, K / sub-block], d (and dmin) fp16
[N, K/256]. Kept here, below formats, layouts and io, so the layout that stores these bytes and
the GGUF reader share one conversion.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

SUPER_BLOCK = 256
BLOCK_BYTES = {"q2_k": 84, "q3_k": 110, "q4_k": 144, "q5_k": 176, "q6_k": 210}
# each type's value structure by code width: (type, sub-block, code offset, has mins): w = d s q - dmin m
# (the affine types) or d s (q - offset); one type per width, so a kernel's code_bits names it
STRUCTURES = {2: ("q2_k", 16, 0, True), 3: ("q3_k", 16, 4, False), 4: ("q4_k", 32, 0, True),
              5: ("q5_k", 32, 0, True), 6: ("q6_k", 16, 32, False)}



def buffer_problem(codes: Tensor, code_bits: int, sub_scales: Tensor, sub_mins, d: Tensor, dmin, sub_block: int,
                   code_offset: int) -> tuple[Optional[str], int, int]:
    """(what is wrong with these kquant_stream buffers or None, N, K): one MSB-first code stream per row
    (int32 [N, K b / 32]), int8 sub-block scales (uint8 mins) [N, K / sub_block], fp16 d (dmin)
    [N, K / 256], the structure of one of the five types. The kquant ops' check (ops/kquant.py) and
    their Triton launchers' (triton_kernels/kquant.py)."""
    if code_bits not in STRUCTURES:
        return f"code_bits must be one of {tuple(STRUCTURES)} (q2_k .. q6_k), got {code_bits}", 0, 0
    name, sub, offset, mins = STRUCTURES[code_bits]
    if (sub_block, code_offset, sub_mins is not None) != (sub, offset, mins):
        return (f"{code_bits}-bit codes are {name}: sub_block {sub}, code_offset {offset}, "
                f"{'with' if mins else 'without'} sub_mins / dmin; got {sub_block}, {code_offset}, "
                f"{'with' if sub_mins is not None else 'without'}"), 0, 0
    if d.dtype != torch.float16 or d.dim() != 2:
        return f"d must be 2-D fp16 [N, K/{SUPER_BLOCK}], got {d.dtype} {tuple(d.shape)}", 0, 0
    n, k = d.shape[0], d.shape[1] * SUPER_BLOCK
    if sub_scales.dtype != torch.int8 or tuple(sub_scales.shape) != (n, k // sub_block):
        return f"sub_scales must be int8 [{n}, {k // sub_block}] (one per {sub_block} weights)", n, k
    if (sub_mins is None) != (dmin is None):
        return "sub_mins and dmin come together (the affine types) or not at all", n, k
    if sub_mins is not None and (sub_mins.dtype != torch.uint8 or sub_mins.shape != sub_scales.shape):
        return "sub_mins must be uint8 shaped like sub_scales", n, k
    if dmin is not None and (dmin.dtype != torch.float16 or dmin.shape != d.shape):
        return "dmin must be fp16 shaped like d", n, k
    words = k * code_bits // 32
    if codes.dtype != torch.int32 or tuple(codes.shape) != (n, words):
        return f"codes must be int32 [{n}, {words}] (one {code_bits}-bit MSB-first stream per row)", n, k
    return None, n, k

def _shifts(device, *widths: int) -> Tensor:
    return torch.tensor(widths, dtype=torch.uint8, device=device)


def _split_bits(packed: Tensor, bits: int, fields: int) -> Tensor:
    """uint8 [..., B] -> [..., fields, B]: field j is bits j*bits .. j*bits + bits - 1 of each byte."""
    shifts = _shifts(packed.device, *range(0, bits * fields, bits)).reshape(fields, 1)
    return (packed.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)


def _join_bits(fields: Tensor, bits: int) -> Tensor:
    """Inverse of _split_bits: [..., fields, B] (each below 2^bits) -> uint8 [..., B]."""
    shifts = _shifts(fields.device, *range(0, bits * fields.shape[-2], bits)).reshape(-1, 1)
    out = torch.zeros(fields.shape[:-2] + fields.shape[-1:], dtype=torch.uint8, device=fields.device)
    for j in range(fields.shape[-2]):
        out |= fields[..., j, :].to(torch.uint8) << shifts[j]
    return out


def _fp16(raw: Tensor) -> Tensor:
    """uint8 [..., 2] -> fp16 [...], bit for bit."""
    return raw.contiguous().view(torch.float16)[..., 0]


def _fp16_bytes(t: Tensor) -> Tensor:
    return t.to(torch.float16).contiguous().unsqueeze(-1).view(torch.uint8)


def _split_k4_scales(raw: Tensor) -> tuple[Tensor, Tensor]:
    """q4_k / q5_k scales[12] -> (scales, mins) uint8 [..., 8], 6 bits each (ggml's get_scale_min_k4:
    sub-blocks 0-3 in the low 6 bits of bytes 0-7, 4-7 split between bytes 8-11 and the top 2 bits)."""
    lo, mid, hi = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    scales = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return scales, mins


def _join_k4_scales(scales: Tensor, mins: Tensor) -> Tensor:
    s, m = scales.to(torch.uint8), mins.to(torch.uint8)
    lo = (s[..., :4] & 63) | ((s[..., 4:] >> 4) << 6)
    mid = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    hi = (s[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return torch.cat([lo, mid, hi], dim=-1)


def _split_q3_scales(raw: Tensor) -> Tensor:
    """q3_k scales[12] -> int8 [..., 16] in -32..31: low nibbles in bytes 0-7 (sub-blocks 0-7 low,
    8-15 high nibble), the top 2 bits of sub-block 4j + b in bits 2j of byte 8 + b."""
    low = _split_bits(raw[..., :8], 4, 2).reshape(raw.shape[:-1] + (16,))
    high = _split_bits(raw[..., 8:12], 2, 4).reshape(raw.shape[:-1] + (16,))
    return ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8)


def _join_q3_scales(sub_scales: Tensor) -> Tensor:
    u = (sub_scales.to(torch.int16) + 32).to(torch.uint8)
    lead = u.shape[:-1]
    low = _join_bits((u & 15).reshape(lead + (2, 8)), 4)
    high = _join_bits((u >> 4).reshape(lead + (4, 4)), 2)
    return torch.cat([low, high], dim=-1)


def blocks_to_tensors(fmt_name: str, raw: Tensor) -> dict[str, Tensor]:
    """uint8 [N, K/256 * block bytes] -> the format's tensors (see the module docstring)."""
    nbytes = BLOCK_BYTES[fmt_name]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"{fmt_name}: block bytes must be uint8 [rows, super-blocks * {nbytes}], got "
                         f"{raw.dtype} {list(raw.shape)}")
    n = raw.shape[0]
    b = raw.reshape(n, -1, nbytes)
    nb = b.shape[1]

    def codes(t: Tensor) -> Tensor:  # [N, nb, ..., 256 in order] -> [N, K]
        return t.reshape(n, nb * SUPER_BLOCK).to(torch.uint8)

    if fmt_name == "q2_k":
        scales, qs = b[..., :16], b[..., 16:80]
        return {"codes": codes(_split_bits(qs.reshape(n, nb, 2, 32), 2, 4)),
                "sub_scales": (scales & 15).reshape(n, -1), "sub_mins": (scales >> 4).reshape(n, -1),
                "d": _fp16(b[..., 80:82]), "dmin": _fp16(b[..., 82:84])}
    if fmt_name == "q3_k":
        hmask, qs, scales = b[..., :32], b[..., 32:96], b[..., 96:108]
        low = _split_bits(qs.reshape(n, nb, 2, 32), 2, 4).reshape(n, nb, SUPER_BLOCK)
        high = _split_bits(hmask, 1, 8).reshape(n, nb, SUPER_BLOCK)
        return {"codes": codes(low | (high << 2)), "sub_scales": _split_q3_scales(scales).reshape(n, -1),
                "d": _fp16(b[..., 108:110])}
    if fmt_name in ("q4_k", "q5_k"):
        scales, mins = _split_k4_scales(b[..., 4:16])
        q = {"sub_scales": scales.reshape(n, -1), "sub_mins": mins.reshape(n, -1),
             "d": _fp16(b[..., 0:2]), "dmin": _fp16(b[..., 2:4])}
        qs = b[..., -128:]
        low = _split_bits(qs.reshape(n, nb, 4, 32), 4, 2).reshape(n, nb, SUPER_BLOCK)
        if fmt_name == "q5_k":
            low = low | (_split_bits(b[..., 16:48], 1, 8).reshape(n, nb, SUPER_BLOCK) << 4)
        return {"codes": codes(low), **q}
    if fmt_name == "q6_k":
        ql, qh, scales = b[..., :128], b[..., 128:192], b[..., 192:208]
        low = _split_bits(ql.reshape(n, nb, 2, 64), 4, 2).reshape(n, nb, SUPER_BLOCK)
        high = _split_bits(qh.reshape(n, nb, 2, 32), 2, 4).reshape(n, nb, SUPER_BLOCK)
        return {"codes": codes(low | (high << 4)), "sub_scales": scales.contiguous().view(torch.int8).reshape(n, -1),
                "d": _fp16(b[..., 208:210])}
    raise ValueError(f"no K-quant block type for format {fmt_name!r}; known: {', '.join(BLOCK_BYTES)}")


def tensors_to_blocks(fmt_name: str, q: dict[str, Tensor]) -> Tensor:
    """Inverse of blocks_to_tensors: the format's tensors -> uint8 [N, K/256 * block bytes]."""
    if fmt_name not in BLOCK_BYTES:
        raise ValueError(f"no K-quant block type for format {fmt_name!r}; known: {', '.join(BLOCK_BYTES)}")
    c = q["codes"].to(torch.uint8)
    n, k = c.shape
    nb = k // SUPER_BLOCK
    c = c.reshape(n, nb, SUPER_BLOCK)

    def per_block(t: Tensor) -> Tensor:
        return t.reshape(n, nb, -1).to(torch.uint8)

    if fmt_name == "q2_k":
        parts = [per_block(q["sub_scales"]) | (per_block(q["sub_mins"]) << 4),
                 _join_bits(c.reshape(n, nb, 2, 4, 32), 2).reshape(n, nb, 64),
                 _fp16_bytes(q["d"]).reshape(n, nb, 2), _fp16_bytes(q["dmin"]).reshape(n, nb, 2)]
    elif fmt_name == "q3_k":
        parts = [_join_bits((c >> 2).reshape(n, nb, 8, 32), 1),
                 _join_bits((c & 3).reshape(n, nb, 2, 4, 32), 2).reshape(n, nb, 64),
                 _join_q3_scales(q["sub_scales"].reshape(n, nb, 16)),
                 _fp16_bytes(q["d"]).reshape(n, nb, 2)]
    elif fmt_name in ("q4_k", "q5_k"):
        parts = [_fp16_bytes(q["d"]).reshape(n, nb, 2), _fp16_bytes(q["dmin"]).reshape(n, nb, 2),
                 _join_k4_scales(per_block(q["sub_scales"]), per_block(q["sub_mins"]))]
        if fmt_name == "q5_k":
            parts.append(_join_bits((c >> 4).reshape(n, nb, 8, 32), 1))
        parts.append(_join_bits((c & 15).reshape(n, nb, 4, 2, 32), 4).reshape(n, nb, 128))
    else:  # q6_k
        parts = [_join_bits((c & 15).reshape(n, nb, 2, 2, 64), 4).reshape(n, nb, 128),
                 _join_bits((c >> 4).reshape(n, nb, 2, 4, 32), 2).reshape(n, nb, 64),
                 q["sub_scales"].to(torch.int8).contiguous().view(torch.uint8).reshape(n, nb, 16),
                 _fp16_bytes(q["d"]).reshape(n, nb, 2)]
    return torch.cat(parts, dim=-1).reshape(n, nb * BLOCK_BYTES[fmt_name])
