"""Trellis-coded quantization (TCQ) of a standard-Gaussian source: QTIP's bitshift trellis with the
hybrid "quantlut_sym" code (QTIP, Tseng et al. 2024; Q-Palette, Lee et al. 2025). The one place the
TCQ math lives; kernels and decoders must match tcq_state_values() and the packing below.

Trellis. A state is an L = 16-bit integer. Each step emits one 2-D vector (V = 2 weights): the value
of its state, tcq_state_values(bits)[state]. The next state shifts s = round(2 * bits) new bits in at
the bottom: next = ((state << s) | new) & 0xFFFF. A sequence is T = 256 weights = 128 steps and is
tail-biting: the last state's low L - s bits are the first state's high L - s bits, so each step
stores exactly s bits (128 * s bits per sequence, bits/weight = s / 2).

Hybrid code (QTIP quantlut_sym, followed exactly). With h = (state * (state + 1)) mod 2**16 and a
learned table of 2**Q two-dimensional entries (Q = 9 up to 4 bits, 10 at 4.5, 11 at 5.0):
    entry = table[(h >> (15 - Q)) & (2**Q - 1)],   sign = -1 if h bit 15 is set else +1,
    raw value = (sign * entry[0], entry[1]).
QTIP scales each weight matrix to an RMS of 0.9 * RMS(raw values over all 2**16 states) before
encoding (scale_override = 0.9, also Q-Palette's default); for unit-variance input that is the same
as encoding against raw / (0.9 * RMS(raw)), which is what tcq_state_values returns.

Computed code "1mad" (QTIP's 1MAD, one multiply-add per coordinate, made two-dimensional): no
table; coordinate c of a state's value is the sum of the four bytes of (A_c * state + B_c) mod 2**32,
minus 510 (the bytes' mean sum), in units of 1/128:
    value[c] = (bytesum((A_c * state + B_c) mod 2**32) - 510) / 128,   (A_0, B_0) QTIP's 1MAD constants.
A sum of four near-uniform bytes is close to Gaussian (std 147.9 over the 2**16 states), and the
two coordinates are uncorrelated (-0.003). Kernels compute it with a 32-bit multiply, an add and two
byte-pair sums (no memory lookup), and it quantizes N(0, 1) with less error than the hybrid code at
every rate (encoded like it at 0.9 x the code's RMS; MSE at 2 bits 0.0710 vs 0.0721, at 4 bits
0.00485 vs 0.00571). The 1/128 unit is exact in fp32 and keeps fp16 row scales near the weights' RMS.

Packing. The bitstream of one sequence is, for step t = 0..127, the top s bits of state t (the
oldest ones), concatenated MSB first: stream bits [t*s, t*s + s) = state_t >> (L - s).
Then state t is the L-bit window of stream bits [t*s, t*s + L), read MSB first, wrapping around the
end of the 128*s-bit stream (this is what tail-biting buys). The stream is stored in 4*s int32 words
(128*s is always a multiple of 32): word j holds stream bits [32j, 32j + 32), stream bit 32j being
the word's most significant bit. Reading state t: with bit position q = t*s, word w = q // 32 and
offset o = q % 32, state = ((u32(words[w]) << 32 | u32(words[(w + 1) % (4s)])) >> (48 - o)) & 0xFFFF.
Codes of a matrix [R, C] are int32 [R, C // 256, 4 * s]: sequence c of row r covers x[r, 256c:256c+256],
step t encodes the pair (x[r, 256c + 2t], x[r, 256c + 2t + 1]).

Encoder. A Viterbi pass costs O(2**L) per step: the predecessors of state n are the 2**s states whose
low L - s bits equal n >> s (a "group"), so the min over each group is taken once and shared by its
2**s successors. Tail-biting is done QTIP's way: a first unconstrained pass over the sequence rotated
by half its length fixes state 0's high L - s bits (the "overlap"); a second pass starts only from
states with those bits and ends only in states whose low L - s bits equal them.
"""
from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from ..core.tcq_codes import (MAD_INCREMENTS, MAD_MULTIPLIERS, MAD_OFFSET, MAD_TABLE_BITS, MAD_UNIT,  # noqa: F401
                         kernel_table_shape)
from ..ops.palette import register_viterbi_reference

TCQ_L = 16
TCQ_V = 2
TCQ_T = 256
TCQ_STEPS = TCQ_T // TCQ_V
TCQ_SUPPORTED_BITS = tuple(b / 2 for b in range(3, 11))  # 1.5, 2.0, ..., 5.0
VITERBI_DEVICE_BYTES = 1 << 30  # working set of the reference Viterbi on a GPU (tcq_viterbi)
QTIP_SCALE_OVERRIDE = 0.9  # encoded RMS relative to the code's RMS (QTIP / Q-Palette default)

TCQ_CODES = ("hyb", "1mad")  # QTIP's hybrid lookup code; the computed 1MAD pair code

_TABLES_FILE = os.path.join(os.path.dirname(__file__), "data", "tcq_tables.safetensors")
_STATE_MASK = (1 << TCQ_L) - 1


def _check_bits(bits: float) -> float:
    if not any(bits == b for b in TCQ_SUPPORTED_BITS):
        supported = ", ".join(f"{b:g}" for b in TCQ_SUPPORTED_BITS)
        raise ValueError(f"TCQ: unsupported bits {bits!r}; supported bits per weight: {supported}")
    return float(bits)


def tcq_shift_bits(bits: float) -> int:
    """s: bits shifted into the state per step (one step = 2 weights)."""
    return round(2 * _check_bits(bits))


def tcq_table_bits(bits: float) -> int:
    """Q: log2 of the hybrid code's table size (Q-Palette: 9 up to 4 bits, 10 at 4.5, 11 at 5)."""
    b = _check_bits(bits)
    return 9 if b <= 4 else (10 if b == 4.5 else 11)


@functools.lru_cache(maxsize=None)
def _load_tables() -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(_TABLES_FILE)


def table_key(table_bits: int) -> str:
    """The name of the Q-bit table in the shipped tables file."""
    return f"q{table_bits}"


def tcq_lut(bits: float) -> Tensor:
    """fp32 [2**Q, 2]: the learned table of the hybrid code (made by torch_lowbit/tools/gen_tcq_tables.py)."""
    return _load_tables()[table_key(tcq_table_bits(bits))].clone()


def hybrid_code_values(table: Tensor, table_bits: int) -> Tensor:
    """QTIP's quantlut_sym: fp32 [2**L, 2], the unscaled value of every state given the table."""
    state = torch.arange(1 << TCQ_L, dtype=torch.int64, device=table.device)
    h = (state * (state + 1)) & _STATE_MASK
    sign = 1 - 2 * ((h >> 15) & 1)
    index = (h >> (15 - table_bits)) & ((1 << table_bits) - 1)
    values = table[index].clone()
    values[:, 0] *= sign.to(values.dtype)
    return values


@functools.lru_cache(maxsize=None)
def _scaled_table(bits: float) -> Tensor:
    table = tcq_lut(bits)
    rms = hybrid_code_values(table, tcq_table_bits(bits)).double().square().mean().sqrt()
    return (table.double() / (rms * QTIP_SCALE_OVERRIDE)).float()


def tcq_scaled_table(bits: float) -> Tensor:
    """fp32 [2**Q, 2]: the hybrid code's table with the unit-variance scaling folded in, so that
    tcq_state_values(bits) == hybrid_code_values(tcq_scaled_table(bits), Q). The fused kernels decode
    states with it (hash + 2**Q-entry lookup) instead of reading the 2**16-entry state table."""
    return _scaled_table(_check_bits(bits)).clone()


def tcq_signed_table(bits: float) -> Tensor:
    """fp32 [2**(Q+1), 2]: tcq_scaled_table followed by its copy with the first coordinate negated, so
    that a state's value is entry (h >> (15 - Q)) mod 2**(Q+1) (bit 15 of h, the sign, is the index's
    top bit). The CPU kernels decode with it (csrc/common/palette.h)."""
    table = tcq_scaled_table(bits)
    return torch.cat([table, table * torch.tensor([-1.0, 1.0])]).contiguous()


def _check_code(code: str) -> str:
    if code not in TCQ_CODES:
        raise ValueError(f"TCQ: unknown code {code!r}; codes: {', '.join(TCQ_CODES)}")
    return code


@functools.lru_cache(maxsize=None)
def _mad_values() -> Tensor:
    state = torch.arange(1 << TCQ_L, dtype=torch.int64)
    coords = []
    for a, b in zip(MAD_MULTIPLIERS, MAD_INCREMENTS):
        z = (a * state + b) & 0xFFFFFFFF
        coords.append(sum((z >> (8 * i)) & 0xFF for i in range(4)) - MAD_OFFSET)
    return torch.stack(coords, 1).float() * MAD_UNIT  # exact: integers times a power of two


def mad_code_values() -> Tensor:
    """fp32 [2**L, 2]: the 1mad code's value of every state, in its units of 1/128 (module docstring)."""
    return _mad_values().clone()


@functools.lru_cache(maxsize=None)
def mad_unit_scale() -> float:
    """mad_code_values() * mad_unit_scale() is the code at 1 / 0.9 of unit RMS (QTIP's encoding scale)."""
    return float(1.0 / (_mad_values().double().square().mean().sqrt() * QTIP_SCALE_OVERRIDE))


@functools.lru_cache(maxsize=None)
def _state_values(bits: float, code: str = "hyb") -> Tensor:
    if code == "1mad":
        return (_mad_values().double() * mad_unit_scale()).float()
    return hybrid_code_values(_scaled_table(bits), tcq_table_bits(bits))


def tcq_state_values(bits: float, code: str = "hyb") -> Tensor:
    """fp32 [2**L, 2]: the 2-D value each state decodes to, for unit-variance data."""
    return _state_values(_check_bits(bits), _check_code(code)).clone()


def tcq_kernel_table_bits(bits: float, code: str = "hyb") -> int:
    """The kernels' table_bits: Q for the hybrid code, MAD_TABLE_BITS for the 1mad code (no table)."""
    return MAD_TABLE_BITS if _check_code(code) == "1mad" else tcq_table_bits(bits)


def tcq_kernel_state_values(table: Tensor, table_bits: int) -> Tensor:
    """fp32 [2**L, 2]: each state's value as the decode kernels compute it from their table argument
    (tcq_kernel_table): the hybrid code's from the signed table's first half (tcq_scaled_table), the 1mad
    code's in its own units (table_bits MAD_TABLE_BITS: no table; as TCQ.decode_tables)."""
    if table_bits == MAD_TABLE_BITS:
        return _mad_values().to(table.device)
    return hybrid_code_values(table[:1 << table_bits], table_bits)


def tcq_kernel_table(bits: float, code: str = "hyb") -> Tensor:
    """The table the decode kernels take: the signed table for the hybrid code; an empty [0, 2] one
    for the 1mad code, which the kernels compute."""
    return torch.zeros(0, 2) if _check_code(code) == "1mad" else tcq_signed_table(bits)


# ----------------------------------------------------------------------------------------------
# Packing


def tcq_pack_states(states: Tensor, bits: float) -> Tensor:
    """int32 [..., 4*s] words from tail-biting state paths int [..., 128] (see module docstring)."""
    s = tcq_shift_bits(bits)
    states = states.to(torch.int64)
    if states.shape[-1] != TCQ_STEPS:
        raise ValueError(f"TCQ: state paths must have {TCQ_STEPS} steps, got {states.shape[-1]}")
    nxt = torch.roll(states, -1, dims=-1)
    if bool(((states & ((1 << (TCQ_L - s)) - 1)) != (nxt >> s)).any()):
        raise ValueError("TCQ: state path is not a tail-biting trellis path")
    chunks = states >> (TCQ_L - s)  # [..., 128] s-bit chunks of the stream
    bit_weights = 1 << torch.arange(s - 1, -1, -1, device=states.device)
    stream = ((chunks[..., None] & bit_weights) != 0).flatten(-2)  # [..., 128*s], MSB first
    word_weights = 1 << torch.arange(31, -1, -1, device=states.device)
    words = (stream.unflatten(-1, (4 * s, 32)).to(torch.int64) * word_weights).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def tcq_unpack_states(words: Tensor, bits: float) -> Tensor:
    """int32 [..., 128]: state t of each sequence = L-bit window at bit t*s of its stream."""
    s = tcq_shift_bits(bits)
    if words.shape[-1] != 4 * s:
        raise ValueError(f"TCQ: a tcq{bits:g} sequence is {4 * s} int32 words, got {words.shape[-1]}")
    u = words.to(torch.int64) & 0xFFFFFFFF
    pos = torch.arange(TCQ_STEPS, device=words.device) * s
    w, o = pos // 32, pos % 32
    pair = (u[..., w] << 32) | u[..., (w + 1) % (4 * s)]
    return ((pair >> (48 - o)) & _STATE_MASK).to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Decoding


def tcq_decode(codes: Tensor, bits: float, cols: int, code: str = "hyb") -> Tensor:
    """fp32 [R, cols] from codes int32 [R, cols // 256, 4*s]: the reference decoder (unit variance)."""
    s = tcq_shift_bits(bits)
    if cols % TCQ_T != 0 or codes.dim() != 3 or codes.shape[1:] != (cols // TCQ_T, 4 * s):
        raise ValueError(f"TCQ: codes must be [R, {cols // TCQ_T}, {4 * s}] for cols={cols} at tcq{bits:g}, "
                         f"got {tuple(codes.shape)}")
    states = tcq_unpack_states(codes, bits)
    values = _state_values(bits, _check_code(code)).to(codes.device)[states.long()]  # [R, C/256, 128, 2]
    return values.reshape(codes.shape[0], cols)


# ----------------------------------------------------------------------------------------------
# Encoding


def _viterbi_pass(steps: Tensor, values: Tensor, s: int, overlap: Tensor | None) -> Tensor:
    """One Viterbi pass over steps [B, 128, 2]; returns state paths int64 [B, 128].

    overlap None: free start and end. Else [B]: the start state's high L - s bits (its predecessor
    group) and the end state's low L - s bits (its successor group) are both fixed to overlap."""
    batch = steps.shape[0]
    groups, fan = 1 << (TCQ_L - s), 1 << s
    # group_cost[b, g]: best cost of a path whose last state's low L-s bits are g.
    if overlap is None:
        group_cost = steps.new_zeros(batch, groups)
    else:
        group_cost = steps.new_full((batch, groups), float("inf"))
        group_cost.scatter_(1, overlap[:, None], 0.0)
    choices = []
    for t in range(TCQ_STEPS):
        dist = (values[None] - steps[:, t, None, :]).square().sum(-1)  # [B, 2**L]
        # State p's predecessors form group p >> s; state p = k * groups + g joins successor group g.
        cost = group_cost.repeat_interleave(fan, dim=1) + dist
        group_cost, k = cost.view(batch, fan, groups).min(dim=1)
        choices.append(k.to(torch.int16))  # k < fan <= 2**10: a quarter of int64's memory
    g = group_cost.argmin(dim=1) if overlap is None else overlap
    rows = torch.arange(batch, device=steps.device)
    path = torch.empty(batch, TCQ_STEPS, dtype=torch.int64, device=steps.device)
    for t in range(TCQ_STEPS - 1, -1, -1):
        state = choices[t][rows, g].long() * groups + g
        path[:, t] = state
        g = state >> s
    return path


def _tail_biting_viterbi(x_seq: Tensor, values: Tensor, s: int) -> tuple[Tensor, Tensor]:
    """The Viterbi of sequences x_seq [B, 256] over state values [2**L, 2] with s bits shifted per step."""
    values = values.to(x_seq.device)
    steps = x_seq.float().reshape(-1, TCQ_STEPS, TCQ_V)
    half = TCQ_STEPS // 2
    first = _viterbi_pass(torch.roll(steps, half, dims=1), values, s, None)
    overlap = first[:, half] >> s  # rotated step `half` is step 0
    path = _viterbi_pass(steps, values, s, overlap)
    err = (values[path] - steps).square().sum(dim=(1, 2))
    return path.to(torch.int32), err


def tcq_viterbi_reference(x_seq: Tensor, bits: float, code: str = "hyb") -> tuple[Tensor, Tensor]:
    """Plain pure-torch tail-biting Viterbi over sequences x_seq [B, 256].

    Returns (states int32 [B, 128], squared error fp32 [B] of decoding those states)."""
    _check_bits(bits)
    _check_sequences(x_seq)
    return _tail_biting_viterbi(x_seq, _state_values(bits, _check_code(code)), tcq_shift_bits(bits))


def _check_sequences(x_seq: Tensor) -> None:
    if x_seq.dim() != 2 or x_seq.shape[1] != TCQ_T:
        raise ValueError(f"TCQ: sequences must be [B, {TCQ_T}], got {tuple(x_seq.shape)}")


def _extension_viterbi(x_seq: Tensor, bits: float, code: str) -> tuple[Tensor, Tensor]:
    from ..ops.palette import tcq_viterbi
    return tcq_viterbi(x_seq, _state_values(bits, code), tcq_shift_bits(bits))


def tcq_viterbi(x_seq: Tensor, bits: float, code: str = "hyb") -> tuple[Tensor, Tensor]:
    """Tail-biting Viterbi of sequences x_seq fp32 [B, 256]: the C++ op on CPU, else the reference.

    Returns (states int32 [B, 128], path error fp32 [B]: the squared error the Viterbi accumulated)."""
    _check_bits(bits)
    _check_code(code)
    if x_seq.device.type == "cpu":
        return _extension_viterbi(x_seq.float().contiguous(), bits, code)
    return _reference_in_slices(x_seq, bits, code)


def viterbi_bytes_per_sequence(bits: float) -> int:
    """The reference Viterbi's working set per sequence: ~6 fp32 [2**L] temporaries per step and the
    [128, 2**(L-s)] int16 back-pointers."""
    return _viterbi_bytes(tcq_shift_bits(bits))


def _viterbi_bytes(s: int) -> int:
    return 6 * 4 * (1 << TCQ_L) + 2 * TCQ_STEPS * (1 << (TCQ_L - s))


def _reference_in_slices(x_seq: Tensor, bits: float, code: str = "hyb") -> tuple[Tensor, Tensor]:
    return _viterbi_in_slices(x_seq, _state_values(bits, code), tcq_shift_bits(bits))


def _viterbi_in_slices(x_seq: Tensor, values: Tensor, s: int) -> tuple[Tensor, Tensor]:
    """The reference Viterbi over slices of the batch. Each sequence holds [2**L] fp32 costs per step
    and [128, 2**(L-s)] int16 choices: all at once, a 4096-row matrix would need tens of GiB of GPU
    memory; a slice stays within VITERBI_DEVICE_BYTES. Also the tcq_viterbi op's CPU reference where the
    extension is absent."""
    _check_sequences(x_seq)
    chunk = max(1, VITERBI_DEVICE_BYTES // _viterbi_bytes(s))
    parts = [_tail_biting_viterbi(x_seq[i:i + chunk], values, s) for i in range(0, x_seq.shape[0], chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


register_viterbi_reference(_viterbi_in_slices)


def tcq_encode(x: Tensor, bits: float, code: str = "hyb") -> Tensor:
    """int32 codes [R, C // 256, 4*s] of x [R, C] (C % 256 == 0, roughly unit variance)."""
    _check_bits(bits)
    _check_code(code)
    if x.dim() != 2 or x.shape[1] % TCQ_T != 0:
        raise ValueError(f"TCQ: x must be 2-D [R, C] with C a multiple of {TCQ_T}, got {tuple(x.shape)}")
    if not x.is_floating_point() or not bool(torch.isfinite(x).all()):
        raise ValueError("TCQ: x must be a finite floating-point tensor")
    rows, cols = x.shape
    states, _ = tcq_viterbi(x.float().reshape(-1, TCQ_T).contiguous(), bits, code)
    return tcq_pack_states(states, bits).reshape(rows, cols // TCQ_T, -1)
