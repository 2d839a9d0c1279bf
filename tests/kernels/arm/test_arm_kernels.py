"""ARM kernels without an ARM machine: cross-compile the standalone driver (tests/kernels/arm/kernels_driver.cpp
with csrc/common/{lut_i8,q4x}_scalar.cpp and csrc/arm/*.cpp) with g++-aarch64-linux-gnu and run it under
qemu-aarch64 on three CPU models: `max` (dotprod and i8mm), `cortex-a76` (dotprod, no i8mm) and
`cortex-a53` (plain NEON). The int8-tile kernels (lut_i8) and the interleaved q4_RxS kernels (q4x:
sdot for S = 4, smmla for S = 8) are both checked, the palette kernels (TCQ's computed 1mad code and
hybrid table code, the nuq / vq codebooks in palette_packed: NEON decode bit for bit the x86 scalar
decode, NEON GEMV within fp32 rounding of it), the Hadamard kernels (NEON equal to the portable scalar
code bit for bit, and that within fp32 rounding of a float64 transform), and KV-cache attention
(scalar and NEON tasks within fp32 rounding of a float64 softmax over the dequantized cache). The vectors come from this package: weights packed by the Python layouts,
activations by the Python twin of the kernels' quantizer (which the NEON quantizers must reproduce byte
for byte from the same floats), and the expected output is the x86 scalar kernel's, which every ARM path
must equal bit for bit (the formats' math has one source)."""
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

import torch_lowbit as tl
from conftest import random_linear
from torch_lowbit.core.activations import quantize_sub_blocks
from torch_lowbit.core.activations import quantize_q8_blocks

ROOT = Path(__file__).resolve().parents[3]
CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
CPU_MODELS = {"max": (True, True), "cortex-a76": (True, False), "cortex-a53": (False, False)}  # dotprod, i8mm
# K-quants in kquant_i8_n16 (integer sub-scales; 5-, 6-bit codes in 4 + 1 / 4 + 2 planes): sub-blocks of
# 16 (q2_k with mins, q3_k and q6_k with offsets 4 / 32) and 32 (q4_k, q5_k with mins); K a multiple of the
# 256-weight super-block, one or two super-blocks per row (groups), odd N
KQUANT_CASES = [("q2_k", 37, 256, 3, True), ("q3_k", 21, 512, 1, False), ("q4_k", 19, 512, 5, True),
                ("q5_k", 33, 256, 2, False), ("q6_k", 23, 512, 4, True), ("q5_k", 9, 512, 1, True)]
KQUANTS = {case[0] for case in KQUANT_CASES}
# (format, out N, in K, tokens M, bias[, per-token activation bits]): odd N (a ragged last tile), several
# groups, M = 1..33; the cases with activation bits run QuaRot's per-token A8 / A4 (int32 group sums), the
# last two its sub-block activations (two-level scales in blocks of 16 / 8)
CASES = [("q4_0", 37, 96, 1, True), ("q4_0", 16, 64, 33, False), ("int4_g64", 50, 128, 5, True),
         ("q5_0", 29, 96, 3, True), ("q5_1", 17, 128, 2, False),  # 5-bit codes: a 4-bit and a 1-bit plane
         ("iq4_nl", 23, 64, 2, False), ("q8_0", 29, 96, 3, True), ("int2_g64", 17, 64, 4, True),
         ("int3_g64", 9, 128, 1, False), ("int1_g32", 33, 64, 2, True), ("int2_sym_g32", 16, 96, 3, False),
         ("q4_0", 21, 96, 3, True, 8), ("int4_g64", 19, 128, 2, False, 4), ("iq4_nl", 40, 64, 5, True, 8),
         ("int4_pc", 18, 160, 1, True, 4), ("gcb2", 37, 256, 3, True), ("gcb3_sb64", 21, 128, 2, False),
         ("vq2", 29, 192, 3, True), ("vq1.5", 16, 128, 1, False),
         ("q4_0", 27, 96, 3, True, 4, 16), ("int4_g64", 19, 128, 2, False, 2, 8),
         *KQUANT_CASES]

pytestmark = pytest.mark.skipif(shutil.which(CXX) is None or shutil.which(QEMU) is None,
                                reason=f"needs {CXX} and {QEMU} (Debian: apt-get install g++-aarch64-linux-gnu "
                                       "qemu-user; .ci/setup installs them where it runs as root)")


# (layout, format, N, K, M, bias, per-token activation bits): odd N, several groups (int4_pc: one per row),
# odd and even token counts (i8mm runs tokens in pairs)
Q4X_CASES = [("q4_4x4", "q4_0", 37, 96, 1, True, 0), ("q4_4x4", "iq4_nl", 23, 64, 3, False, 0),
             ("q4_4x8", "q4_0", 29, 128, 5, True, 0), ("q4_4x8", "int4_pc", 18, 160, 2, False, 8),
             ("q4_8x8", "q4_0", 43, 64, 4, True, 4), ("q4_8x8", "iq4_nl", 16, 96, 1, True, 0),
             ("q4_4x4", "int4_pc", 13, 128, 6, True, 4), ("q4_8x8", "int4_pc", 9, 192, 7, False, 8)]


# (format, N, K, M, bias): TCQ codes of random words (every state pattern, the tail-biting wrap); 1mad at 1.5, 2, 3.5
# and 5 bits cover s = 3 (windows at every bit offset), 4 (two words per row), 7 and 10 (the widest rows);
# the hybrid code (tcq{b}) at s = 3, 4, 6, 9, 10 reads tables of Q = 9, 10 and 11 bits
TCQ_CASES = [("tcq2_1mad", 48, 272, 1, True), ("tcq1.5_1mad", 32, 256, 3, False), ("tcq3.5_1mad", 16, 512, 6, True),
             ("tcq5_1mad", 32, 128, 5, False), ("tcq2", 16, 256, 2, True), ("tcq1.5", 32, 256, 1, False),
             ("tcq3", 16, 272, 4, True), ("tcq4.5", 16, 128, 7, False), ("tcq5", 32, 160, 8, True)]


# (format or None: a random table, code bits, weights per code, N, K, M, bias): random code words in the
# palette_packed layout (every bit pattern; 3-, 5-, 6-, 10- and 12-bit codes crossing words); odd N, codes
# per row not a multiple of 16 (a ragged last vector) and per-stream bits not a multiple of 32; M = 1..8
# (token blocks of 4 plus 1-4). nuq1-4, vq1.5 and vq2 (<= 16 entries) take the register tables (the
# formats' tables are integers, whose low bytes are 0: random tables check every byte), vq2.5 .. vq5
# (32-1024 entries) and the 12-bit tables the per-lane loads.
CODEBOOK_CASES = [("nuq1", 1, 1, 7, 1000, 1, False), ("nuq2", 2, 1, 37, 200, 1, True),
                  ("nuq3", 3, 1, 21, 250, 8, True), ("nuq4", 4, 1, 19, 328, 3, False),
                  ("vq1.5", 3, 2, 16, 360, 2, False), ("vq2", 4, 2, 23, 256, 5, True),
                  (None, 4, 1, 11, 120, 3, True), (None, 3, 2, 17, 360, 2, False),
                  ("vq2.5", 5, 2, 29, 202, 1, True), ("vq3", 6, 2, 17, 384, 4, False),
                  ("vq4", 8, 2, 31, 186, 7, True), ("vq5", 10, 2, 15, 154, 8, True),
                  (None, 12, 1, 13, 333, 2, True), (None, 12, 2, 9, 100, 6, False)]


# (k, len): k blocks of len floats through the Walsh-Hadamard kernel, then mixed by a random +-1 k x k
# matrix (k = 1: no mix; k % 4 != 0 and len < 4: the scalar fallback); 4096 and 8192 pass the 2048-float L1 chunk
HADAMARD_CASES = [(1, 8), (1, 16), (1, 4096), (1, 8192), (12, 128), (28, 64), (4, 4), (20, 32), (3, 8), (40, 16)]


def _hadamard_case_bytes(k, length, gen) -> bytes:
    x = torch.randn(k * length, generator=gen)
    mix = torch.randint(0, 2, (k, k), generator=gen).float() * 2 - 1
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < length:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # Sylvester: the butterflies' order
    y = x.double().view(k, length) @ h
    expected = mix.double() @ y if k > 1 else y
    return b"".join([_i64(k, length), x.numpy().tobytes(), mix.numpy().tobytes(),
                     expected.float().contiguous().numpy().tobytes()])


# (bits, head dim, group, G query heads, query rows, cached positions L, mask, exact ring length R): decode
# (1 row) and prefill blocks; "causal" holes every row's future (-inf) and the first row entirely,
# "finfo" masks with transformers' finfo.min; 8 rows x 8 heads is the most queries a task holds (64)
KV_CASES = [(4, 64, 64, 3, 1, 37, None, 0), (4, 32, 16, 4, 5, 29, "causal", 0), (8, 48, 8, 2, 9, 45, "finfo", 5),
            (4, 128, 32, 8, 8, 70, "causal", 0), (4, 24, 8, 5, 3, 9, None, 3), (8, 64, 64, 1, 17, 40, "causal", 4)]


def _kv_case_bytes(bits, d, group, g, rows, length, mask_kind, ring, gen) -> bytes:
    width = d * bits // 8
    k_codes, v_codes = (torch.randint(0, 256, (length, width), generator=gen, dtype=torch.uint8) for _ in range(2))
    k_scale, v_scale = (torch.rand(length, d // group, generator=gen).mul(0.1).add(0.02).half() for _ in range(2))
    k_min, v_min = (torch.rand(length, d // group, generator=gen).sub(0.5).half() for _ in range(2))
    q = torch.randn(rows, g, d, generator=gen)
    recent_hi = length - 2 if ring else 0  # positions [hi - R, hi) come exact from the rings
    k_ring, v_ring = torch.randn(max(ring, 1), d, generator=gen), torch.randn(max(ring, 1), d, generator=gen)

    def values(codes, scale, mn, exact):
        if bits == 4:
            c = torch.stack([codes & 15, codes >> 4], -1).reshape(length, d)
        else:
            c = codes
        v = c.double() * scale.double().repeat_interleave(group, 1) + mn.double().repeat_interleave(group, 1)
        for j in range(max(recent_hi - ring, 0), recent_hi):
            v[j] = exact[j % ring].double()
        return v
    keys, vals = values(k_codes, k_scale, k_min, k_ring), values(v_codes, v_scale, v_min, v_ring)
    mask = torch.zeros(rows, length)
    if mask_kind:
        last = length - rows + torch.arange(rows)
        hidden = torch.arange(length)[None, :] > last[:, None]
        hidden[0] = True  # the first row sees no key: NaN (-inf) or a uniform average (finfo.min)
        mask[hidden] = float("-inf") if mask_kind == "causal" else torch.finfo(torch.float32).min
    scale = d ** -0.5
    s = torch.einsum("rgd,ld->rgl", q.double(), keys) * scale + mask.double()[:, None, :]
    expected = s.softmax(-1) @ vals  # [rows, g, d]; all -inf rows come out NaN
    head = _i64(bits, d, group, g, rows, length, mask_kind is not None, ring, recent_hi)
    parts = [head] + [t.contiguous().numpy().tobytes() for t in (k_codes, v_codes)]
    parts += [t.view(torch.int16).contiguous().numpy().tobytes() for t in (k_scale, k_min, v_scale, v_min)]
    parts += [t.float().contiguous().numpy().tobytes() for t in (q, mask, k_ring, v_ring, expected)]
    return b"".join(parts)


def _i64(*values):
    return struct.pack(f"<{len(values)}q", *values)


def _per_token_codes(x, bits, clip):
    """The kernel's per-token rounding (fake_quantize_per_token's codes): xq, d repeated per block."""
    qmax = 2 ** (bits - 1) - 1
    d = x.abs().amax(-1, keepdim=True) * (clip / qmax)
    d = torch.where(d > 0, d, torch.ones_like(d))
    xq = torch.clamp(torch.round(x / d), -qmax if bits == 8 else -qmax - 1, qmax).to(torch.int8)
    return xq, d.expand(-1, x.shape[1] // 32).contiguous()


def _case_bytes(fmt, n, k, m, bias, gen, act_bits=0, act_block=0) -> bytes:
    kquant = fmt in KQUANTS
    q = tl.QuantLinear.from_linear(random_linear(k, n, bias, gen), fmt, **({"layout": "kquant_i8_n16"} if kquant else {}))
    assert q.layout.name.endswith("_i8_n16"), q.layout.name
    bufs = dict(q.named_buffers())
    sub_block = q.fmt.sub_block if kquant else 0  # integer sub-scales (and sub_mins) per sub_block features
    gcb = "sub_groups" in bufs  # group codebooks: the codebooks back to back, superblock scales
    pairs = not gcb and bufs["lut_i8"].dim() == 2  # vq: one table per coordinate, one group per row
    table = (bufs["codebooks"] if gcb else bufs["lut_i8"]).reshape(-1).to(torch.int8)
    offset = -int(table.min())
    utable = torch.zeros(256, dtype=torch.uint8)
    utable[:table.numel()] = (table.to(torch.int32) + offset).to(torch.uint8)
    group = q.fmt.superblock if gcb else k if pairs else q.fmt.group_size
    scales = bufs["super_scales"] if gcb else bufs["scales"]
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen).add(0.2)
    clip = 0.9
    xk = x  # what the kernel rounds: vq's rotated input in pair-split order
    if pairs:
        xk = q.fmt.rotate_activations(x, bufs["signs"]).reshape(m, k // 64, 32, 2).transpose(-1, -2).reshape(m, k)
    if act_block:
        xq, xd = quantize_sub_blocks(xk, act_bits, clip, act_block)
    else:
        xq, xd = _per_token_codes(xk, act_bits, clip) if act_bits else quantize_q8_blocks(xk)
    xsum = xq.to(torch.int32).reshape(m, k // 32, 32).sum(-1).to(torch.int32)
    gdsum = torch.zeros(m, k // group)
    per = group // 32
    for g in range(k // group):  # fp32 sums in block order, as group_dsums
        s = torch.zeros(m)
        for b in range(g * per, (g + 1) * per):
            s = s + xd[:, b] * xsum[:, b].float()
        gdsum[:, g] = s
    with tl.use_backend("cpu", path="scalar"):
        expected = tl.ActQuantLinear(q, act_bits, clip_ratio=clip, block=act_block)(x) if act_bits else q(x)
    mins = bufs.get("mins")
    bits = q.fmt.bits if gcb else q.fmt.code_bits if pairs or kquant else q.layout.bits
    parts = [_i64(bits, n, k, group, m, mins is not None, bias, offset, act_bits, act_block, gcb, pairs, sub_block),
             utable.numpy().tobytes(),
             bufs["qweight"].contiguous().numpy().tobytes(), scales.contiguous().view(torch.int16).numpy().tobytes()]
    if mins is not None:
        parts.append(mins.contiguous().view(torch.int16).numpy().tobytes())
    if bias:
        parts.append(q.bias.float().contiguous().numpy().tobytes())
    if gcb:
        parts.append(bufs["sub_groups"].contiguous().numpy().tobytes())
    if kquant:
        assert bufs["sub_scales"].dtype == torch.int8 and bufs["sub_scales"].shape[1] == k // sub_block
        parts.append(bufs["sub_scales"].contiguous().numpy().tobytes())
        if mins is not None:
            parts.append(bufs["sub_mins"].contiguous().numpy().tobytes())
    parts += [xk.float().contiguous().numpy().tobytes(), xq.contiguous().numpy().tobytes(), xd.float().contiguous().numpy().tobytes(),
              xsum.contiguous().numpy().tobytes()]
    if sub_block == 16:  # Q8Acts::half_sum: q summed over each 16 features
        parts.append(xq.to(torch.int32).reshape(m, k // 16, 16).sum(-1).to(torch.int32).contiguous().numpy().tobytes())
    parts += [gdsum.contiguous().numpy().tobytes(), expected.float().contiguous().numpy().tobytes()]
    return b"".join(parts)


def _q4x_case_bytes(layout, fmt, n, k, m, bias, act_bits, gen) -> bytes:
    q = tl.QuantLinear.from_linear(random_linear(k, n, bias, gen), fmt, layout=layout)
    bufs = dict(q.named_buffers())
    table = bufs["lut_i8"].to(torch.int8)
    toggled = bool(torch.equal(table, torch.arange(16, dtype=torch.int8) - 8))
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen).add(0.2)
    xq, xd = _per_token_codes(x, act_bits, 0.9) if act_bits else quantize_q8_blocks(x)
    xsum = xq.to(torch.int32).reshape(m, k // 32, 32).sum(-1).to(torch.int32)
    with tl.use_backend("cpu", path="scalar"):
        expected = tl.ActQuantLinear(q, act_bits, clip_ratio=0.9)(x) if act_bits else q(x)
    parts = [_i64(q.layout.rows, q.layout.chunk, n, k, q.fmt.group_size, m, bias, act_bits > 0, toggled),
             table.numpy().tobytes(), bufs["qweight"].contiguous().numpy().tobytes(),
             bufs["scales"].contiguous().view(torch.int16).numpy().tobytes()]
    if bias:
        parts.append(q.bias.float().contiguous().numpy().tobytes())
    parts += [xq.contiguous().numpy().tobytes(), xd.float().contiguous().numpy().tobytes(),
              xsum.contiguous().numpy().tobytes(), expected.float().contiguous().numpy().tobytes()]
    return b"".join(parts)


def _tcq_case_bytes(fmt, n, k, m, bias, gen) -> bytes:
    from torch_lowbit.formats import tcq
    f = tl.get_format(fmt)
    s = tcq.tcq_shift_bits(f.bits)
    codes = torch.randint(-2**31, 2**31 - 1, (n // 16, k // 16, 4 * s), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = torch.rand(n, generator=gen).add(0.5).half()
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    table, table_bits = tcq.tcq_kernel_table(f.bits, f.code), tcq.tcq_kernel_table_bits(f.bits, f.code)
    with tl.use_backend("cpu", path="scalar"):
        w = torch.ops.torch_lowbit.tcq_dequantize(codes, table, table_bits, s, scales)
        y = torch.ops.torch_lowbit.tcq_linear(x, codes, table, table_bits, s, scales, b)
    parts = [_i64(s, table_bits, n, k, m, bias, table.shape[0]), table.contiguous().numpy().tobytes(),
             codes.contiguous().numpy().tobytes(), scales.view(torch.int16).numpy().tobytes()]
    if bias:
        parts.append(b.numpy().tobytes())
    parts += [x.numpy().tobytes(), w.contiguous().numpy().tobytes(), y.float().contiguous().numpy().tobytes()]
    return b"".join(parts)


def _codebook_case_bytes(fmt, bits, dim, n, k, m, bias, gen) -> bytes:
    from torch_lowbit.layouts.palette_packed import _codebook
    from torch_lowbit.core.packing import stream_words
    table = _codebook(tl.get_format(fmt)) if fmt else torch.randn(2 ** bits, dim, generator=gen)
    assert table.shape == (2 ** bits, dim), (fmt, table.shape)
    words = stream_words(k // dim, bits)
    codes = torch.randint(-2**31, 2**31 - 1, (n, words), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = torch.rand(n, generator=gen).add(0.5).half()
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k, generator=gen)
    with tl.use_backend("cpu", path="scalar"):
        w = torch.ops.torch_lowbit.codebook_dequantize(codes, bits, table, scales, k)
        y = torch.ops.torch_lowbit.codebook_linear(x, codes, bits, table, scales, b)
    acts = x.view(m, k // dim, dim).permute(2, 0, 1)  # the op's planes of x'
    parts = [_i64(bits, dim, n, k, m, bias), table.t().contiguous().numpy().tobytes(), codes.numpy().tobytes(),
             scales.view(torch.int16).numpy().tobytes()]
    if bias:
        parts.append(b.numpy().tobytes())
    parts += [acts.contiguous().numpy().tobytes(), w.contiguous().numpy().tobytes(), y.float().contiguous().numpy().tobytes()]
    return b"".join(parts)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    out = tmp_path_factory.mktemp("arm") / "kernels_driver"
    sources = ["tests/kernels/arm/kernels_driver.cpp", "csrc/common/lut_i8_scalar.cpp", "csrc/arm/lut_i8_neon.cpp",
               "csrc/arm/lut_i8_dotprod.cpp", "csrc/common/q4x_scalar.cpp", "csrc/arm/q4x_dotprod.cpp",
               "csrc/arm/q4x_i8mm.cpp", "csrc/arm/act_q8_neon.cpp", "csrc/common/palette_scalar.cpp",
               "csrc/arm/palette_neon.cpp", "csrc/arm/palette_codebook_neon.cpp", "csrc/common/hadamard_scalar.cpp", "csrc/arm/hadamard_neon.cpp",
               "csrc/common/kv_attention_scalar.cpp", "csrc/arm/kv_attention_neon.cpp"]
    torch_include = Path(torch.__file__).parent / "include"
    # -ffp-contract=off: as the extension's flags, no fused multiply-add the source does not spell out
    cmd = [CXX, "-O2", "-std=c++17", "-ffp-contract=off", "-static", f"-I{ROOT / 'csrc'}", f"-I{torch_include}",
           *[str(ROOT / s) for s in sources], "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def vectors(tmp_path_factory):
    seed = int.from_bytes(os.urandom(4), "little")  # fresh data each run; the seed is in every failure message
    gen = torch.Generator().manual_seed(seed)
    path = tmp_path_factory.mktemp("arm") / "kernel_vectors.bin"
    path.write_bytes(_i64(len(CASES)) + b"".join(_case_bytes(*case[:5], gen, *case[5:]) for case in CASES)
                     + _i64(len(Q4X_CASES)) + b"".join(_q4x_case_bytes(*case, gen) for case in Q4X_CASES)
                     + _i64(len(TCQ_CASES)) + b"".join(_tcq_case_bytes(*case, gen) for case in TCQ_CASES)
                     + _i64(len(CODEBOOK_CASES)) + b"".join(_codebook_case_bytes(*case, gen) for case in CODEBOOK_CASES)
                     + _i64(len(HADAMARD_CASES)) + b"".join(_hadamard_case_bytes(*case, gen) for case in HADAMARD_CASES)
                     + _i64(len(KV_CASES)) + b"".join(_kv_case_bytes(*case, gen) for case in KV_CASES))
    return path, seed


@pytest.mark.parametrize("cpu", list(CPU_MODELS))
def test_arm_int8_tile_kernels_equal_the_x86_scalar_kernel_under_qemu(driver, vectors, cpu):
    path, seed = vectors
    r = subprocess.run([QEMU, "-cpu", cpu, str(driver), str(path)], capture_output=True, text=True, timeout=600)
    # the failing lines first (the tail alone may not reach the int8-tile cases)
    failing = "\n".join(line for line in r.stdout.splitlines() if "MISMATCH" in line or "FAR" in line)
    assert r.returncode == 0 and "ALL EQUAL" in r.stdout, (f"seed {seed}\n{failing}\n" + r.stdout[-3000:]
                                                           + r.stderr[-2000:])
    dotprod, i8mm = CPU_MODELS[cpu]
    assert f"dotprod: {'yes' if dotprod else 'no'}" in r.stdout and f"i8mm: {'yes' if i8mm else 'no'}" in r.stdout
    lines = r.stdout.splitlines()
    assert sum("neon activation quantizer: equal" in line for line in lines) == len(CASES)
    paths = {line.rsplit(" ", 2)[-2].rstrip(":") for line in lines if line.startswith("case ") and "quantizer" not in line}
    assert paths == ({"scalar", "neon", "dotprod"} if dotprod else {"scalar", "neon"})
    q4x = {line.rsplit(" ", 2)[-2].rstrip(":") for line in r.stdout.splitlines() if line.startswith("q4x case ")}
    assert q4x == {"scalar"} | ({"dotprod"} if dotprod else set()) | ({"i8mm"} if i8mm else set())
    tcq = [line for line in lines if line.startswith("tcq case ")]
    assert len(tcq) == 2 * len(TCQ_CASES) and all(line.endswith(": equal") for line in tcq)
    codebook = [line for line in lines if line.startswith("codebook case ")]
    assert len(codebook) == 2 * len(CODEBOOK_CASES) and all(line.endswith(": equal") for line in codebook)
    hadamard = [line for line in lines if line.startswith("hadamard case ")]
    assert len(hadamard) == len(HADAMARD_CASES) and all(line.endswith(": equal") for line in hadamard)
    kv = [line for line in lines if line.startswith("kv case ")]
    assert len(kv) == 2 * len(KV_CASES) and all(line.endswith(": close") for line in kv)
