"""Q-Palette formats (nuq*, vq*, tcq*): codebooks, distortion on a Gaussian, incoherence processing,
and the whole foundation (QuantLinear, fusion, quantize_, compile, save/load)."""
import math

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.formats import palette_codebooks as gc
from torch_lowbit.tools import gen_palette_tables
from torch_lowbit.formats.palette import NUQ, TCQ, VQ, HalfTCQ
from torch_lowbit.ops import cpu_extension

from conftest import assert_matches_product, tiny_llama


def normalized_mse(fmt, w):
    q = fmt.quantize(w)
    return float(((fmt.dequantize(q) - w) ** 2).sum() / (w ** 2).sum())


def test_nuq_tables_regenerate_exactly():
    shipped = gc._shipped()
    for b in gc.NUQ_BITS:
        assert torch.equal(gen_palette_tables.lloyd_max_gaussian(b).float(), shipped[gc.nuq_key(b)]), b


def test_small_vq_tables_regenerate_exactly():
    shipped = gc._shipped()
    for key, table in gen_palette_tables.generate_tables(vq_bits=(1.5,)).items():
        assert torch.equal(table, shipped[key]), key


@pytest.mark.slow
def test_vq_tables_regenerate_exactly_up_to_3_bits():
    shipped = gc._shipped()
    for key, table in gen_palette_tables.generate_tables(vq_bits=(2.0, 2.5, 3.0)).items():
        assert torch.equal(table, shipped[key]), key


def test_lloyd_max_levels_meet_the_known_distortions():
    # Max (1960): MSE of the optimal 1..4-bit quantizers of N(0, 1)
    known = {1: 1 - 2 / math.pi, 2: 0.1175, 3: 0.03454, 4: 0.009497}
    x = torch.randn(1 << 21, dtype=torch.float64)
    for b, d in known.items():
        levels = gc.nuq_levels(b).double()
        err = ((x[:, None] - levels[None]) ** 2).min(1).values.mean().item()
        assert abs(err - d) / d < 0.02, (b, err, d)
        assert torch.equal(levels, -levels.flip(0))  # symmetric


@pytest.mark.parametrize("name,bound", [("nuq2", 0.119), ("nuq3", 0.0352), ("vq2", 0.110), ("vq3", 0.030)])
def test_distortion_targets_on_a_gaussian(name, bound):
    w = torch.randn(256, 4096)
    err = normalized_mse(tl.get_format(name), w)
    assert err <= bound, (name, err)
    # and not absurdly below the Gaussian rate-distortion bound 2^(-2b)
    assert err >= 2 ** (-2 * tl.get_format(name).bits)


def test_more_bits_less_distortion():
    w = torch.randn(64, 1024)
    for family, bits in (("nuq", gc.NUQ_BITS), ("vq", gc.VQ_BITS[:5])):
        errs = [normalized_mse(tl.get_format(f"{family}{b:g}"), w) for b in bits]
        assert all(a > b for a, b in zip(errs, errs[1:])), (family, errs)


def test_rotation_spreads_outliers():
    """Incoherence processing: a weight with outlier input features loses far less with the rotation."""
    w = torch.randn(128, 512) * 0.02
    w[:, ::37] *= 30
    rotated = normalized_mse(NUQ(bits=3), w)
    plain = normalized_mse(NUQ(bits=3, rotate=False), w)
    assert rotated < 0.6 * plain, (rotated, plain)


def test_dequantize_undoes_the_rotation():
    w = torch.randn(48, 320)
    for fmt in (NUQ(bits=4), VQ(bits=4.0), NUQ(bits=4, seed=3)):
        q = fmt.quantize(w)
        assert q["signs"].shape == (320,) and q["row_scales"].shape == (48,)
        err = float(((fmt.dequantize(q) - w) ** 2).sum() / (w ** 2).sum())
        assert err < 0.02, (fmt.name, err)
    assert NUQ(bits=4, seed=3).name == "nuq4_s3" and NUQ(bits=4, rotate=False).name == "nuq4_norot"
    assert not torch.equal(NUQ(bits=4).quantize(w)["signs"], NUQ(bits=4, seed=3).quantize(w)["signs"])


def test_nuq_codes_use_an_int8_table():
    t = NUQ(bits=3).code_values()
    assert torch.equal(t, t.round()) and t.max() == 127 and t.min() == -127


def test_small_vq_codebooks_are_integer_and_run_on_the_int8_tiles():
    """vq1.5 / vq2: <= 16 points on the |t| <= 64 grid (the int8 tiles' pair mode); larger codebooks stay
    fp32 (palette_packed); a width the tiles cannot hold (K not a multiple of 64) falls back."""
    for bits in (1.5, 2.0):
        t = VQ(bits=bits).code_values()
        assert torch.equal(t, t.round()) and t.abs().max() == 64 and t.shape == (2 ** round(2 * bits), 2)
    assert not torch.equal(VQ(bits=3.0).code_values(), VQ(bits=3.0).code_values().round())
    assert tl.QuantLinear.from_linear(torch.nn.Linear(192, 16), "vq2").layout.name == "vq_i8_n16"
    assert tl.QuantLinear.from_linear(torch.nn.Linear(96, 16), "vq2").layout.name == "palette_packed"
    assert tl.QuantLinear.from_linear(torch.nn.Linear(192, 16), "vq2.5").layout.name == "palette_packed"
    with pytest.raises(ValueError, match="divisible by 64"):
        tl.QuantLinear.from_linear(torch.nn.Linear(96, 16), "vq2", layout="vq_i8_n16")
    with pytest.raises(ValueError, match="cannot hold format vq3"):
        tl.QuantLinear.from_linear(torch.nn.Linear(192, 16), "vq3", layout="vq_i8_n16")


def test_pair_codebook_op_checks_its_tables():
    """torch_lowbit::lut_i8_linear's pair mode (a [2, 2^b] lut) against a pure-torch product, and its errors."""
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    from torch_lowbit.core.packing import pack_codes
    n, k, bits = 21, 320, 4
    codes = torch.randint(0, 16, (n, k // 2), generator=gen, dtype=torch.uint8)
    lut = torch.randint(-64, 65, (2, 16), generator=gen).to(torch.int8)
    scales = (torch.rand(n, generator=gen) + 0.5).half()
    qweight = pack_codes(codes, bits)
    tiles = qweight.shape[0]
    sc = torch.nn.functional.pad(scales, (0, tiles * 16 - n)).reshape(tiles, 1, 16)
    x = torch.randn(3, k, generator=gen)
    y = torch.ops.torch_lowbit.lut_i8_linear(x, qweight, sc, None, lut, bits, k, n, None)
    w = torch.stack([lut[0][codes.long()], lut[1][codes.long()]], -1).reshape(n, k).double() * scales.double()[:, None]
    from torch_lowbit.core.activations import fake_quantize_q8_blocks
    split = x.reshape(3, k // 64, 32, 2).transpose(-1, -2).reshape(3, k)
    xq = fake_quantize_q8_blocks(split).reshape(3, k // 64, 2, 32).transpose(-1, -2).reshape(3, k)
    torch.testing.assert_close(y.double(), xq.double() @ w.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match=r"int8 \[2, 16\]"):
        torch.ops.torch_lowbit.lut_i8_linear(x, qweight, sc, None, lut[:, :8].contiguous(), bits, k, n, None)
    with pytest.raises(RuntimeError, match="groups of 64k"):
        torch.ops.torch_lowbit.lut_i8_linear(x, qweight, sc.expand(tiles, 10, 16).contiguous(), None, lut, bits, 32,
                                             n, None)


@pytest.mark.parametrize("fmt,layout,tol", [("nuq4", "nuq_i8_n16", 0.3), ("vq2", "vq_i8_n16", 0.6),
                                            ("vq3", "palette_packed", 0.5),
                                            ("tcq2.75", "palette_packed", 0.6), ("tcq2.25", "palette_packed", 0.6),
                                            ("tcq2_1mad", "palette_packed", 0.6)])
def test_quantize_model_fused_compile_and_checkpoint(tmp_path, fmt, layout, tol):
    model = tiny_llama()
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        ref = model(x).logits
    tl.quantize_(model, fmt)
    attn = model.model.layers[0].self_attn
    fused = attn.qkv_proj
    assert fused.fmt.name == fmt and fused.split_sizes and fused.layout.name == layout
    assert fused.signs.shape == (128,)  # one rotation for q, k and v
    with torch.no_grad():
        y = model(x).logits
    assert (y - ref).norm() / ref.norm() < tol
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        yc = compiled(x).logits
    # inductor reorders the float ops before the kernels (norms, the rotation's fp32 cast); with int8
    # activations (nuq_i8_n16) a value on a rounding boundary may then land one int8 step away
    assert ((yc - y).norm() / y.norm()).item() < (1e-2 if "_i8_" in layout else 1e-4)
    path = tmp_path / "m.safetensors"
    tl.save_quantized(model, path)
    loaded = tl.load_quantized(tiny_llama(), path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, y)


def test_bad_inputs_are_rejected_clearly():
    with pytest.raises(ValueError, match="bits must be one of"):
        NUQ(bits=5)
    with pytest.raises(ValueError, match="bits must be one of"):
        VQ(bits=2.25)
    with pytest.raises(ValueError, match="Hadamard"):
        NUQ(bits=3).quantize(torch.randn(8, 100))
    with pytest.raises(ValueError, match="importance"):
        NUQ(bits=3).quantize(torch.randn(8, 64), importance=torch.ones(64))
    with pytest.raises(ValueError, match="not divisible"):
        VQ(bits=2.0, rotate=False).quantize(torch.randn(8, 63))
    w = torch.randn(8, 64)
    w[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        VQ(bits=2.0).quantize(w)


@pytest.mark.parametrize("fmt", ["nuq2", "vq2", "tcq2", "tcq2.25"])
def test_ldlq_lowers_output_error_over_rtn(fmt):
    from torch_lowbit.calibrate.ldlq import ldlq_quantize
    f = tl.get_format(fmt)
    w = torch.randn(32, 128) * 0.05
    x = torch.randn(1024, 128) @ (torch.randn(128, 128) * 0.3 + torch.eye(128))  # correlated inputs
    h = x.T @ x / x.shape[0]
    out_err = lambda q: float(((x @ (f.dequantize(q) - w).T) ** 2).mean())  # noqa: E731
    rtn, ldlq = f.quantize(w), ldlq_quantize(f, w, h)
    assert set(ldlq) == set(rtn) and all(ldlq[k].shape == rtn[k].shape for k in rtn)
    assert out_err(ldlq) < 0.85 * out_err(rtn), (out_err(ldlq), out_err(rtn))


def test_ldlq_lazy_batches_change_nothing():
    from torch_lowbit.calibrate.ldlq import ldlq_quantize
    f = tl.get_format("nuq3")
    w = torch.randn(16, 192, dtype=torch.float64).float()
    x = torch.randn(512, 192) @ (torch.randn(192, 192) * 0.2 + torch.eye(192))
    h = x.T @ x / x.shape[0]
    a, b = ldlq_quantize(f, w, h, lazy_columns=1), ldlq_quantize(f, w, h, lazy_columns=64)
    # same algorithm, updates grouped differently: codes agree but for float rounding near midpoints
    assert (a["codes"] != b["codes"]).float().mean() < 0.01


# ---- palette_packed: the fused CPU kernels -------------------------------------------------------

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
