"""Bit packing shared by the layouts and kernels: the bottom layer (imports torch only).

Three arrangements, each the one place its bit order is defined (the C++ and Triton kernels read
exactly these bytes):
- MSB-first bit streams (`pack_stream(s)`): one stream per row, or 16 round-robin streams per row
  (code j to stream j % 16, word w of stream l at column 16 w + l; csrc/common/palette.h);
- 16-row tiles of 32-code blocks split into bit planes (`pack_codes`, `tile_rows_codes`;
  csrc/common/lut_i8.h);
- nibbles in ggml's Q4_0 half-split order (`pack_nibbles`; csrc/common/lut4.h);
- little-endian bit fields in bytes (`pack_bitfields`: code j at bit j * bits of its row, LSB first;
  8- and 16-bit codes are plain bytes / little-endian uint16; the gvq layouts).
"""
from __future__ import annotations

import torch
from torch import Tensor

GCB_SUBGROUP = 32  # weights per group-codebook sub-group byte (formats/gcb.py, the gcb kernels)

# The code widths each packing and its ops take, defined here once and read by the layouts, the ops'
# checks (torch_lowbit/ops/) and the Triton launchers (the C++ check of lut_i8_linear spells its sets
# out and names these constants beside it: csrc/lut_i8_linear.cpp).
STREAM_CODE_BITS = (1, 2, 3, 5, 8)  # one stream per row: layout stream_rowmajor, ops lowbit_*
GCB_CODE_BITS = (2, 3)  # group-codebook codes: gcb_rowmajor (ops gcb_*), gcb_i8_n16 (lut_i8_linear's sub_groups)

STREAMS = 16  # a row's codes dealt round-robin to 16 bit streams (csrc/common/palette.h)


_BIT_CHUNK = 1 << 24  # bits expanded at once by the bitwise stream (un)packers: 128 MiB of int64


def _in_row_chunks(fn, t: Tensor, bits_per_row: int, *args) -> Tensor:
    """fn(t, *args) over blocks of rows, so that a big layer's one-int64-a-bit expansion stays bounded
    (a 4096 x 14336 6-bit weight at once: 2.8 GB)."""
    rows = max(1, _BIT_CHUNK // max(1, bits_per_row))
    return torch.cat([fn(t[i:i + rows], *args) for i in range(0, t.shape[0], rows)])


def pack_stream(codes: Tensor, bits: int) -> Tensor:
    """Codes [N, C] (values < 2^bits) -> int32 [N, W]: one MSB-first bit stream per row, padded to a word."""
    n, c = codes.shape
    if bits != 8 and n > 1 and n * c * bits > _BIT_CHUNK:
        return _in_row_chunks(pack_stream, codes, c * bits, bits)
    if bits == 8:  # whole bytes: the same stream, built bytewise (the bitwise route takes 64 B a code)
        b = torch.cat([codes.to(torch.int64), codes.new_zeros(n, -c % 4, dtype=torch.int64)], 1).reshape(n, -1, 4)
        w = (b[..., 0] << 24) | (b[..., 1] << 16) | (b[..., 2] << 8) | b[..., 3]
        return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)
    words = -(-c * bits // 32)
    shifts = torch.arange(bits - 1, -1, -1, device=codes.device)
    stream = ((codes.to(torch.int64)[..., None] >> shifts) & 1).reshape(n, c * bits)
    stream = torch.cat([stream, stream.new_zeros(n, words * 32 - c * bits)], 1).reshape(n, words, 32)
    w = (stream << torch.arange(31, -1, -1, device=codes.device)).sum(-1)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def unpack_stream(words: Tensor, bits: int, count: int) -> Tensor:
    """Inverse of pack_stream: int64 codes [N, count]."""
    if bits != 8 and words.shape[0] > 1 and words.numel() * 32 > _BIT_CHUNK:
        return _in_row_chunks(unpack_stream, words, words.shape[1] * 32, bits, count)
    u = words.to(torch.int64) & 0xFFFFFFFF
    if bits == 8:
        return ((u[..., None] >> torch.tensor([24, 16, 8, 0], device=words.device)) & 255).reshape(
            words.shape[0], -1)[:, :count]
    stream = (u[..., None] >> torch.arange(31, -1, -1, device=words.device)) & 1
    stream = stream.reshape(words.shape[0], -1)[:, :count * bits].reshape(words.shape[0], count, bits)
    return (stream << torch.arange(bits - 1, -1, -1, device=words.device)).sum(-1)


def stream_words(count: int, bits: int) -> int:
    """int32 words per row holding `count` codes of `bits` bits in the 16-stream layout."""
    per_stream = -(-count // STREAMS)
    return STREAMS * -(-per_stream * bits // 32)


def pack_streams(codes: Tensor, bits: int) -> Tensor:
    """Codes [N, C] -> int32 [N, stream_words(C, bits)]: code j to stream j % 16 at position j // 16,
    word w of stream l at column 16 w + l (zero codes pad C to a multiple of 16)."""
    n, c = codes.shape
    per_stream = -(-c // STREAMS)
    padded = torch.cat([codes, codes.new_zeros(n, per_stream * STREAMS - c)], 1)
    lanes = padded.reshape(n, per_stream, STREAMS).permute(0, 2, 1).reshape(n * STREAMS, per_stream)
    return pack_stream(lanes, bits).reshape(n, STREAMS, -1).permute(0, 2, 1).reshape(n, -1).contiguous()


def unpack_streams(words: Tensor, bits: int, count: int) -> Tensor:
    """Inverse of pack_streams: int64 codes [N, count]."""
    n = words.shape[0]
    per_stream = -(-count // STREAMS)
    lanes = words.reshape(n, -1, STREAMS).permute(0, 2, 1).reshape(n * STREAMS, -1)
    codes = unpack_stream(lanes, bits, per_stream).reshape(n, STREAMS, per_stream).permute(0, 2, 1)
    return codes.reshape(n, per_stream * STREAMS)[:, :count]


def bitfield_bytes(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def pack_bitfields(codes: Tensor, bits: int) -> Tensor:
    """Codes [N, C] (values < 2^bits, bits 1..16) -> uint8 [N, bitfield_bytes(C, bits)]: code j of a row
    at bits j * bits .. j * bits + bits - 1 of its bytes, least significant bit first."""
    n, c = codes.shape
    if bits in (8, 16):  # whole bytes
        b = codes.to(torch.int64)
        return (b[..., None] >> torch.arange(0, bits, 8, device=codes.device) & 255).reshape(n, -1).to(torch.uint8)
    if n > 1 and n * c * bits > _BIT_CHUNK:
        return _in_row_chunks(pack_bitfields, codes, c * bits, bits)
    nbytes = bitfield_bytes(c, bits)
    stream = ((codes.to(torch.int64)[..., None] >> torch.arange(bits, device=codes.device)) & 1).reshape(n, c * bits)
    stream = torch.cat([stream, stream.new_zeros(n, nbytes * 8 - c * bits)], 1).reshape(n, nbytes, 8)
    return (stream << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def unpack_bitfields(packed: Tensor, bits: int, count: int) -> Tensor:
    """Inverse of pack_bitfields: int64 codes [N, count]."""
    n = packed.shape[0]
    b = packed.to(torch.int64)
    if bits in (8, 16):
        per = bits // 8
        return (b[:, :count * per].reshape(n, count, per) << torch.arange(0, bits, 8, device=b.device)).sum(-1)
    if n > 1 and packed.numel() * 8 > _BIT_CHUNK:
        return _in_row_chunks(unpack_bitfields, packed, packed.shape[1] * 8, bits, count)
    stream = ((b[..., None] >> torch.arange(8, device=b.device)) & 1).reshape(n, -1)[:, :count * bits]
    return (stream.reshape(n, count, bits) << torch.arange(bits, device=b.device)).sum(-1)


TILE = 16
# (width, shift) of each plane a b-bit code is split into, in storage order.
PLANES = {8: ((8, 0),), 6: ((4, 0), (2, 4)), 5: ((4, 0), (1, 4)), 4: ((4, 0),), 3: ((2, 0), (1, 2)), 2: ((2, 0),),
          1: ((1, 0),)}
LUT_I8_CODE_BITS = tuple(sorted(PLANES))  # the tiles' widths: layouts lut{b}_i8_n16, op lut_i8_linear


def pad_rows(t: Tensor, rows: int) -> Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [N, K] (K % 32 == 0, values < 2^bits) -> qweight [ceil(N/16), K/32, 64 bits]."""
    if bits in ROW_BYTE_CODE_BITS:
        return tile_row_bytes(row_bytes(codes.to(torch.uint8), bits), bits)
    n, k = codes.shape
    tiles, kb = -(-n // TILE), k // 32
    c = pad_rows(codes, tiles * TILE).reshape(tiles, TILE, kb, 8, 4)  # t, r, block, quad, j
    chunks = []
    for w, shift in PLANES[bits]:
        v = ((c >> shift) & ((1 << w) - 1)).reshape(tiles, TILE, kb, 8 // w, w, 4)  # quad = field * w + chunk
        byte = sum(v[:, :, :, f] << (w * f) for f in range(8 // w))  # t, r, block, chunk, j
        chunks.append(byte.permute(0, 2, 3, 1, 4))  # t, block, chunk, r, j
    return torch.cat(chunks, dim=2).reshape(tiles, kb, 64 * bits).to(torch.uint8).contiguous()


def tile_row_bytes(b: Tensor, bits: int) -> Tensor:
    """pack_codes of 4- or 8-bit codes given as row bytes (row_bytes): a (tile, block)'s chunk c, byte
    r*4 + j is row r's block byte 4c + j (4 bits: codes 4c + j and 16 + 4c + j in one byte, as a plane
    of width 4 holds quads c and 4 + c), so packing only moves bytes."""
    n = b.shape[0]
    tiles, kb = -(-n // TILE), b.shape[1] // (4 * bits)
    t = pad_rows(b, tiles * TILE).reshape(tiles, TILE, kb, bits, 4)  # t, r, block, chunk, j
    return t.permute(0, 2, 3, 1, 4).reshape(tiles, kb, 64 * bits).contiguous()


def _row_codes(b: Tensor, bits: int) -> Tensor:
    """A row's bytes per block [..., K/32, bits (chunk), 4 (j)] -> its uint8 codes [..., K]."""
    *lead, kb, _, _ = b.shape
    codes = torch.zeros(*lead, kb, 8, 4, dtype=torch.uint8, device=b.device)
    at = 0
    for w, shift in PLANES[bits]:
        plane = b[..., at:at + w, :]  # block, chunk, j
        at += w
        fields = torch.stack([(plane >> (w * f)) & ((1 << w) - 1) for f in range(8 // w)], dim=-3)
        codes |= fields.reshape(*lead, kb, 8, 4) << shift  # quad = field * w + chunk
    return codes.reshape(*lead, kb * 32)


def unpack_codes(qweight: Tensor, bits: int, out_features: int) -> Tensor:
    tiles, kb, _ = qweight.shape
    b = qweight.reshape(tiles, kb, bits, TILE, 4).permute(0, 3, 1, 2, 4)  # t, r, block, chunk, j
    return _row_codes(b, bits).reshape(tiles * TILE, kb * 32)[:out_features]


def tile_rows_codes(qweight: Tensor, bits: int, rows: Tensor) -> Tensor:
    """The uint8 codes [len(rows), K] of the given rows of pack_codes' tiles, reading only their bytes
    (an embedding lookup's gather)."""
    tiles, kb, _ = qweight.shape
    b = qweight.reshape(tiles, kb, bits, TILE, 4)[rows // TILE, :, :, rows % TILE, :]  # n, block, chunk, j
    return _row_codes(b, bits)


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes [N, K] (K % 32 == 0, values < 16) -> [N, K/2] bytes in 32-code half-split order."""
    n, k = codes.shape
    c = codes.reshape(n, k // 32, 2, 16)
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(packed: Tensor) -> Tensor:
    n, half = packed.shape
    b = packed.reshape(n, half // 16, 16)
    return torch.stack((b & 0x0F, b >> 4), dim=2).reshape(n, half * 2)


ROW_BYTE_CODE_BITS = (4, 8)  # code widths whose rows have a byte form (row_bytes): ggml's block payloads


def row_bytes(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [N, K] as each row's bytes in ggml's block order: 4 bits pack_nibbles' [N, K/2],
    8 bits the codes themselves. A GGUF Q4_0 / Q4_1 / IQ4_NL block's payload is exactly these bytes
    (Q8_0's with each top bit flipped, q + 128), so layouts can pack it without unpacking
    (Layout.pack_row_bytes)."""
    if bits not in ROW_BYTE_CODE_BITS:
        raise ValueError(f"{bits}-bit codes have no row-byte form (only {ROW_BYTE_CODE_BITS})")
    return pack_nibbles(codes) if bits == 4 else codes


def row_bytes_codes(b: Tensor, bits: int) -> Tensor:
    """Inverse of row_bytes: uint8 codes [N, K]."""
    if bits not in ROW_BYTE_CODE_BITS:
        raise ValueError(f"{bits}-bit codes have no row-byte form (only {ROW_BYTE_CODE_BITS})")
    return unpack_nibbles(b) if bits == 4 else b


def interleave_nibble_rows(codes: Tensor, rows: int, chunk: int, toggle: bool) -> Tensor:
    """uint8 codes [N, K] (values < 16, K % 32 == 0) -> [ceil(N/rows), K/32, 16 rows] bytes of the
    interleaved q4_{rows}x{chunk} layouts (csrc/common/q4x.h): each row's block as pack_nibbles' 16 bytes,
    cut into chunks of `chunk` bytes, chunk i of a block = row i % rows's bytes (i // rows) * chunk ..;
    toggle: every nibble's top bit flipped (c ^ 8, the signed value c - 8 in two's complement)."""
    return interleave_nibble_bytes(pack_nibbles(codes), rows, chunk, toggle)


def interleave_nibble_bytes(nibbles: Tensor, rows: int, chunk: int, toggle: bool) -> Tensor:
    """interleave_nibble_rows of codes given as pack_nibbles' bytes [N, K/2] (a GGUF block's payload)."""
    n, half = nibbles.shape
    groups, kb = -(-n // rows), half // 16
    qs = pad_rows(nibbles, groups * rows).reshape(groups, rows, kb, 16 // chunk, chunk)
    if toggle:
        qs = qs ^ 0x88
    return qs.permute(0, 2, 3, 1, 4).reshape(groups, kb, 16 * rows).contiguous()  # group, block, c, r, s


def deinterleave_nibble_rows(packed: Tensor, rows: int, chunk: int, toggle: bool, out_features: int) -> Tensor:
    """Inverse of interleave_nibble_rows: uint8 codes [out_features, K]."""
    groups, kb, _ = packed.shape
    qs = packed.reshape(groups, kb, 16 // chunk, rows, chunk).permute(0, 3, 1, 2, 4)  # group, r, block, c, s
    if toggle:
        qs = qs ^ 0x88
    return unpack_nibbles(qs.reshape(groups * rows, kb * 16))[:out_features]


def interleaved_rows_codes(packed: Tensor, rows: int, chunk: int, toggle: bool, which: Tensor) -> Tensor:
    """The uint8 codes [len(which), K] of the given rows of interleave_nibble_rows' bytes, reading only theirs."""
    groups, kb, _ = packed.shape
    qs = packed.reshape(groups, kb, 16 // chunk, rows, chunk)[which // rows, :, :, which % rows, :]  # n, block, c, s
    if toggle:
        qs = qs ^ 0x88
    return unpack_nibbles(qs.reshape(len(which), kb * 16))
