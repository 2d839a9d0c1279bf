"""palette_packed's fused CPU kernels (nuq / vq codebook and TCQ ops): the code streams, every ISA
path against the scalar path and the format's reference decoder, the 1mad code, the ops' input checks
and torch.compile. The formats themselves: tests/formats/test_palette.py."""
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.formats.palette import TCQ, HalfTCQ
from torch_lowbit.ops import cpu_extension

from conftest import assert_matches_product

SEED_FILE = "test_palette.py"  # split out of tests/test_palette.py: its seeds (conftest.stable_seed)


@pytest.mark.parametrize("bits", [1, 3, 4, 7, 10])
def test_code_streams_round_trip(bits):
    from torch_lowbit.core.packing import pack_streams, stream_words, unpack_streams
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    codes = torch.randint(0, 2 ** bits, (5, 531), generator=gen)
    words = pack_streams(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (5, stream_words(531, bits))
    assert torch.equal(unpack_streams(words, bits, 531), codes)
    # code j is stream j % 16 at position j // 16: stream 3's first code is code 3, MSB first
    assert torch.equal((words[:, 3].to(torch.int64) & 0xFFFFFFFF) >> (32 - bits), codes[:, 3])


@pytest.mark.parametrize("dim,bits", [(1, 1), (1, 2), (1, 3), (1, 4), (2, 3), (2, 4), (2, 5), (2, 6), (2, 7), (2, 8), (2, 9),
                                      (2, 10), (1, 6)])
@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
def test_codebook_kernel_matches_its_definition(dim, bits, path):
    """Random codes and tables (not a format's): whole 512-code periods, a ragged tail, every lookup
    kind (register tables up to 64 entries, gathers beyond), GEMV, token blocks and the decode path."""
    from torch_lowbit.core.packing import pack_streams
    if path not in cpu_extension().available_cpu_paths():
        pytest.skip(f"CPU path {path} not available")
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    n, k = 7, dim * (1024 + 48 + 3)
    codes = torch.randint(0, 2 ** bits, (n, k // dim), generator=gen)
    table = torch.randn(2 ** bits, dim, generator=gen)
    scales = torch.rand(n, generator=gen).add(0.5).half()
    w = table[codes].reshape(n, k) * scales.float()[:, None]
    words = pack_streams(codes, bits)
    with tl.use_backend("cpu", path="scalar"):
        scalar = torch.ops.torch_lowbit.codebook_dequantize(words, bits, table, scales, k)
    with tl.use_backend("cpu", path=path):
        decoded = torch.ops.torch_lowbit.codebook_dequantize(words, bits, table, scales, k)
        torch.testing.assert_close(decoded, w)
        assert torch.equal(decoded, scalar), f"{path} decode differs from scalar"
        for m in (1, 5, 11, 25):  # fused (token blocks of 4 + tail) up to 24 tokens, decode + matmul above
            x = torch.randn(m, k, generator=gen)
            bias = torch.randn(n, generator=gen)
            y = torch.ops.torch_lowbit.codebook_linear(x, words, bits, table, scales, bias)
            assert_matches_product(y, x, w, bias, msg=path)


@pytest.mark.parametrize("fmt", ["tcq1.5", "tcq2", "tcq2.5", "tcq4", "tcq5", "tcq1.5_1mad", "tcq2_1mad",
                                 "tcq3.5_1mad", "tcq5_1mad"])
@pytest.mark.parametrize("path", ["scalar", "avx2", "avxvnni", "avx512"])
def test_tcq_kernel_matches_the_reference_decoder(fmt, path):
    """Random code words (every state pattern, both halves of the signed table or the 1mad code's
    computed values), tail-biting wrap, an odd tile count (17: the one-token tile pairs' tail). The
    avxvnni / avx512 GEMV (vpdpbusd byte sums) must equal the avx2 one (vpmaddubsw + vpmaddwd) bit
    for bit: the same integer sums in the same float order."""
    from torch_lowbit.formats import tcq
    if path not in cpu_extension().available_cpu_paths():
        pytest.skip(f"CPU path {path} not available")
    f = tl.get_format(fmt)
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    n, k, s = 48, 272, tcq.tcq_shift_bits(f.bits)
    codes = torch.randint(-2**31, 2**31 - 1, (n // 16, k // 16, 4 * s), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = torch.rand(n, generator=gen).add(0.5).half()
    w = f.dequantize_rotated({"codes": codes, "row_scales": scales})
    args = (tcq.tcq_kernel_table(f.bits, f.code), tcq.tcq_kernel_table_bits(f.bits, f.code), s, scales)
    with tl.use_backend("cpu", path="scalar"):
        scalar = torch.ops.torch_lowbit.tcq_dequantize(codes, *args)
    with tl.use_backend("cpu", path=path):
        decoded = torch.ops.torch_lowbit.tcq_dequantize(codes, *args)
        torch.testing.assert_close(decoded, w)
        assert torch.equal(decoded, scalar), f"{path} decode differs from scalar"
        for m in (1, 6, 9, 25):  # the fused GEMV up to 24 tokens, decode + at::mm above
            x = torch.randn(m, k, generator=gen)
            bias = torch.randn(n, generator=gen)
            y = torch.ops.torch_lowbit.tcq_linear(x, codes, args[0], args[1], s, args[3], bias)
            assert_matches_product(y, x, w, bias, msg=path)
            if path in ("avxvnni", "avx512"):
                with tl.use_backend("cpu", path="avx2"):
                    y_avx2 = torch.ops.torch_lowbit.tcq_linear(x, codes, args[0], args[1], s, args[3], bias)
                assert torch.equal(y, y_avx2), f"{path} TCQ GEMV differs from avx2's (M = {m})"


def test_signed_table_is_the_hybrid_code():
    from torch_lowbit.formats import tcq
    for bits in (2.0, 4.5, 5.0):
        q = tcq.tcq_table_bits(bits)
        state = torch.arange(1 << 16)
        h = (state * (state + 1)) & 0xFFFF
        idx = (h >> (15 - q)) & ((2 << q) - 1)
        assert torch.equal(tcq.tcq_signed_table(bits)[idx], tcq.tcq_state_values(bits))


def test_mad_code_is_the_documented_formula():
    """The 1mad code's values, recomputed here from its definition; the kernels (csrc/common/palette.h)
    transcribe the same constants, which the kernel tests check through the decoded weights."""
    from torch_lowbit.formats import tcq
    state = torch.arange(1 << 16, dtype=torch.int64)
    expect = []
    for a, b in [(34038481, 76625530), (3188803409, 1013904223)]:
        z = (a * state + b) % 2**32
        expect.append((z % 256 + z // 256 % 256 + z // 65536 % 256 + z // 2**24 - 510) / 128)
    assert torch.equal(tcq.mad_code_values(), torch.stack(expect, 1).float())
    # near-Gaussian, uncorrelated coordinates; the Viterbi targets are 1 / 0.9 of unit RMS
    values = tcq.tcq_state_values(2.0, "1mad").double()
    assert abs(float(values.square().mean().sqrt()) - 1 / 0.9) < 1e-6
    assert abs(float(torch.corrcoef(values.T)[0, 1])) < 0.01


def test_tcq_1mad_format_names_and_errors():
    f = tl.get_format("tcq2_1mad")
    assert (f.bits, f.code, f.name) == (2.0, "1mad", "tcq2_1mad")
    assert HalfTCQ(bits=2.25, code="1mad").name == "tcq2.25_1mad" and tl.get_format("tcq2.25_1mad").code == "1mad"
    with pytest.raises(ValueError, match="code must be one of"):
        TCQ(bits=2.0, code="3inst")
    with pytest.raises(ValueError, match="code must be one of"):
        HalfTCQ(bits=2.25, code="lut")


@pytest.mark.parametrize("fmt", ["tcq2_1mad", "tcq2.25_1mad"])
def test_tcq_1mad_layer_round_trip(fmt, tmp_path):
    """A QuantLinear in the 1mad code (half-TCQ: both halves) runs the kernels, matches its reference
    dequantization, beats the hybrid code's error on Gaussian weights and survives save / load."""
    f = tl.get_format(fmt)
    hyb = tl.get_format(fmt.replace("_1mad", ""))
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    lin = torch.nn.Linear(512, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 512, generator=gen) * 0.02)
    q = tl.QuantLinear.from_linear(lin, f)
    assert q.layout.name == "palette_packed"
    w = q.dequantize()
    err = float((w - lin.weight).square().mean() / lin.weight.square().mean())
    err_hyb = float((tl.QuantLinear.from_linear(lin, hyb).dequantize() - lin.weight).square().mean()
                    / lin.weight.square().mean())
    assert err < 1.03 * err_hyb and err < 0.08
    x = torch.randn(3, 512, generator=gen)
    with torch.no_grad():
        y = q(x)
        assert_matches_product(y, x, w, lin.bias, msg=fmt)
        model = torch.nn.Sequential(q)
        tl.save_quantized(model, tmp_path / "m.safetensors")
        loaded = tl.load_quantized(torch.nn.Sequential(torch.nn.Linear(512, 48)), tmp_path / "m.safetensors")
        assert loaded[0].fmt == f and torch.equal(loaded[0](x), y)


def test_palette_kernel_ops_reject_bad_input():
    from torch_lowbit.formats import tcq
    ops = torch.ops.torch_lowbit
    words = torch.zeros(4, 16, dtype=torch.int32)  # 4-bit codes of 128 pairs: 16 words per row
    table, scales, x = torch.randn(16, 2), torch.ones(4).half(), torch.randn(2, 256)
    ops.codebook_linear(x, words, 4, table, scales, None)
    with pytest.raises(RuntimeError, match=r"codes must be int32 \[N, 16\]"):
        ops.codebook_linear(x, words[:, :15], 4, table, scales, None)
    with pytest.raises(RuntimeError, match="table must be fp32"):
        ops.codebook_linear(x, words, 4, table.double(), scales, None)
    with pytest.raises(RuntimeError, match="row_scales must be fp16"):
        ops.codebook_linear(x, words, 4, table, scales.float(), None)
    codes = torch.zeros(1, 2, 16, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="signed table"):
        ops.tcq_linear(torch.randn(1, 32), codes, tcq.tcq_scaled_table(2.0), 9, 4, torch.ones(16).half(), None)
    with pytest.raises(RuntimeError, match="features but the weight has K=32"):
        ops.tcq_linear(torch.randn(1, 48), codes, tcq.tcq_signed_table(2.0), 9, 4, torch.ones(16).half(), None)
    with pytest.raises(RuntimeError, match="the 1mad code, an empty"):  # table_bits 0 takes no table
        ops.tcq_linear(torch.randn(1, 32), codes, tcq.tcq_signed_table(2.0), 0, 4, torch.ones(16).half(), None)


def test_palette_packed_ops_compile_fullgraph():
    lin = tl.QuantLinear.from_linear(torch.nn.Linear(256, 32), "tcq2.25")
    assert lin.layout.name == "palette_packed"
    x = torch.randn(3, 256)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(lin, fullgraph=True)(x), lin(x))
