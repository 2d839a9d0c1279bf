"""Q-Palette formats (nuq*, vq*, tcq*): codebooks, distortion on a Gaussian, incoherence processing,
and the whole foundation (QuantLinear, fusion, quantize_, compile, save/load). Their fused CPU
kernels (palette_packed): tests/kernels/cpu/test_palette_kernels.py."""
import math

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.formats import palette_codebooks as gc
from torch_lowbit.tools import gen_palette_tables
from torch_lowbit.formats.palette import NUQ, VQ

from conftest import tiny_llama


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
