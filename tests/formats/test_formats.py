"""Format math: ggml bit-compatibility of q4_0, rounding quality, registry and input checks."""
import struct

import numpy as np
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.core.packing import pack_nibbles, unpack_nibbles


def ggml_quantize_row_q4_0_ref(x: np.ndarray) -> bytes:
    """A line-by-line transcription of ggml's quantize_row_q4_0_ref (fp32 arithmetic), producing the
    18-byte blocks (fp16 d, 16 bytes qs) of a GGUF Q4_0 tensor row."""
    qk = 32
    out = bytearray()
    x = x.astype(np.float32)
    for i in range(len(x) // qk):
        amax, vmax = np.float32(0), np.float32(0)
        for j in range(qk):
            v = x[i * qk + j]
            if amax < abs(v):
                amax, vmax = abs(v), v
        d = np.float32(vmax / np.float32(-8))
        idd = np.float32(1.0) / d if d != 0 else np.float32(0)
        qs = bytearray(16)
        for j in range(qk // 2):
            x0 = np.float32(x[i * qk + j] * idd)
            x1 = np.float32(x[i * qk + qk // 2 + j] * idd)
            xi0 = min(15, int(np.float32(x0 + np.float32(8.5))))  # (int8_t) truncates toward zero
            xi1 = min(15, int(np.float32(x1 + np.float32(8.5))))
            qs[j] = xi0 | (xi1 << 4)
        out += struct.pack("<e", d) + bytes(qs)
    return bytes(out)


def test_q4_0_is_bit_compatible_with_ggml_blocks():
    w = torch.randn(5, 96) * torch.tensor([0.01, 0.1, 1.0, 3.0, 50.0]).unsqueeze(1)
    w[1, 3] = 0.0
    w[2, 32:64] = 0.0  # an all-zero block: d = 0
    w[3, 70] = w[3, 64:96].abs().max() * 1.0  # ties between +max and -max
    w[3, 71] = -w[3, 70]
    fmt = tl.get_format("q4_0")
    q = fmt.quantize(w)
    packed = pack_nibbles(q["codes"])
    for r in range(w.shape[0]):
        ours = b"".join(struct.pack("<e", float(q["scales"][r, b])) + bytes(packed[r, b * 16:(b + 1) * 16].tolist())
                        for b in range(3))
        assert ours == ggml_quantize_row_q4_0_ref(w[r].numpy()), f"row {r} differs from ggml"
    # dequantization is ggml's (q - 8) * fp16(d)
    expect = (q["codes"].float() - 8) * q["scales"].float().repeat_interleave(32, 1)
    torch.testing.assert_close(fmt.dequantize(q), expect, rtol=0, atol=0)


def test_nibble_packing_roundtrip_and_order():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 32)
    assert torch.equal(unpack_nibbles(packed), codes)
    assert int(packed[1, 5]) == int(codes[1, 5]) | (int(codes[1, 21]) << 4)  # ggml block order


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_lsq_never_worse_than_minmax(group):
    w = torch.randn(64, 512) * 0.02
    w[:, ::13] += 0.1 * torch.randn(64, 40)  # skewed groups, where min-max wastes levels
    lsq, mm = tl.get_format(f"int4_g{group}"), tl.get_format(f"int4_g{group}_minmax")
    err_lsq = (lsq.dequantize(lsq.quantize(w)) - w).pow(2).sum(1)
    err_mm = (mm.dequantize(mm.quantize(w)) - w).pow(2).sum(1)
    assert err_lsq.sum() < err_mm.sum() * 0.97
    assert bool((err_lsq <= err_mm * 1.001 + 1e-9).all())  # per row, up to fp16 rounding of params


SCALAR = [f for f in tl.formats() if isinstance(tl.get_format(f), tl.ScalarCodebookFormat)]
SCALAR4 = [f for f in SCALAR if tl.get_format(f).code_bits == 4]


@pytest.mark.parametrize("fmt", SCALAR)
def test_importance_lowers_weighted_error(fmt):
    f = tl.get_format(fmt)
    w = torch.randn(48, 256) * 0.05
    imp = torch.rand(256) ** 4 * 100  # a few input features matter far more than the rest
    plain = f.dequantize(f.quantize(w))
    weighted = f.dequantize(f.quantize(w, importance=imp))
    err = lambda d: float(((d - w) ** 2 * imp).sum())  # noqa: E731
    assert err(weighted) < err(plain)


@pytest.mark.parametrize("fmt", SCALAR)
def test_quantization_error_is_small_and_bits_counted(fmt):
    f = tl.get_format(fmt)
    w = torch.randn(64, 256)
    rel = ((f.dequantize(f.quantize(w)) - w).norm() / w.norm()).item()
    # a b-bit uniform grid on a Gaussian: ~0.1 relative RMS at 4 bits, ~2x worse per bit fewer
    # (and 2x better per bit more: q8_0)
    per_bits = 2.2 ** (4 - f.code_bits) if f.code_bits <= 4 else 2.0 ** (4 - f.code_bits)
    assert 0.01 * per_bits < rel < 0.13 * per_bits
    q = tl.QuantLinear.from_weights([w], [None], fmt)
    assert q.weight_nbytes() * 8 / w.numel() == pytest.approx(q.fmt.bits_per_weight())  # int4_pc: bound to K
    assert q.fmt == f.for_layer(256)


def test_fewer_bits_more_error_for_int_formats():
    w = torch.randn(64, 256)
    errs = [float((tl.get_format(f).dequantize(tl.get_format(f).quantize(w)) - w).norm())
            for f in ("int4_g64", "int3_g64", "int2_g64")]
    assert errs[0] < errs[1] < errs[2]
    with pytest.raises(ValueError, match="bits must be 1, 2, 3 or 4"):
        tl.IntAsym(bits=5)


@pytest.mark.parametrize("fmt", ["int4_g64", "int2_sym_g64", "int1_g64", "gcb2"])
def test_gptq_lowers_output_error_over_rtn(fmt):
    from torch_lowbit.calibrate import gptq_quantize
    f = tl.get_format(fmt)
    k = 512 if fmt.startswith("gcb") else 256  # whole 256-weight superblocks
    w = torch.randn(96, k) * 0.05
    x = torch.randn(2048, k) @ (torch.randn(k, k) * 0.2 + torch.eye(k))  # correlated inputs
    h = x.T @ x / x.shape[0]
    rtn = f.dequantize(f.quantize(w))
    gptq = f.dequantize(gptq_quantize(f, w, h))
    out_err = lambda d: float(((x @ (d - w).T) ** 2).mean())  # noqa: E731
    assert out_err(gptq) < 0.8 * out_err(rtn)


def test_registry_and_configs():
    names = tl.formats()
    assert {"q4_0", "int4_g32", "int4_g64", "int4_g128"} <= set(names)
    with pytest.raises(ValueError, match="unknown format 'q3_z'.*registered formats: .*q4_0"):
        tl.get_format("q3_z")
    cfg = tl.Int4(group=64, rounding="minmax")
    assert tl.get_format(cfg) is cfg and cfg.name == "int4_g64_minmax"
    assert tl.format_from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="multiple of 32"):
        tl.Int4(group=48)
    with pytest.raises(TypeError):
        tl.get_format(4)


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g128"])
def test_bad_weights_are_rejected(fmt):
    f = tl.get_format(fmt)
    with pytest.raises(ValueError, match="not divisible by the group size"):
        f.quantize(torch.randn(8, f.group_size + 16))
    w = torch.randn(8, 256)
    w[3, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        f.quantize(w)
    w[3, 7] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        f.quantize(w)
    with pytest.raises(TypeError, match="floating point"):
        f.quantize(torch.randint(0, 4, (8, 256)))
    with pytest.raises(ValueError, match="2-D"):
        f.quantize(torch.randn(256))
    with pytest.raises(ValueError, match="meta device"):
        f.quantize(torch.empty(8, 256, device="meta"))
    with pytest.raises(ValueError, match="importance"):
        f.quantize(torch.randn(8, 256), importance=-torch.ones(256))


def test_int1_is_sign_times_mean_abs():
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    w = torch.randn(6, 128, generator=gen)
    f = tl.get_format("int1_g64")
    assert isinstance(f, tl.IntSym) and f.bits_per_weight() == 1 + 16 / 64
    q = f.quantize(w)
    groups = w.reshape(6, 2, 64)
    expected = torch.sign(groups) * groups.abs().mean(-1, keepdim=True).half().float()
    torch.testing.assert_close(f.dequantize(q), expected.reshape(6, 128))


@pytest.mark.parametrize("bits", [2, 3])
def test_symmetric_refit_never_worse_than_absmax(bits):
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    x = (torch.randn(40, 4, 64, generator=gen) ** 3)  # heavy tails: absmax scales are poor here
    fmt = tl.IntSym(bits=bits, group=64)
    plain = tl.IntSym(bits=bits, group=64, lsq_iters=0)
    values = fmt.code_values()
    assert torch.equal(values, torch.arange(-(2 ** bits - 1), 2 ** bits, 2).float())

    def err(f):
        s, _ = f.fit_groups(x)
        return ((values[f.encode(x, s, None).long()] * s - x) ** 2).sum(-1)
    e_fit, e_plain = err(fmt), err(plain)
    assert bool((e_fit <= e_plain + 1e-6).all()) and e_fit.sum() < 0.9 * e_plain.sum()
    assert fmt.name == f"int{bits}_sym_g64" and tl.IntAsym(bits=1, group=64).name == "int1_asym_g64"


# ---- gcb: group-wise fine-grained codebooks ------------------------------------------------------

def test_gcb_learning_finds_the_distribution_shapes():
    """Two kinds of sub-groups (near-uniform and spiky): phase 1 separates them, phase 2 gives each
    its own codebook, and each kind is coded best by its own codebook."""
    from torch_lowbit.tools.gcb_learn import learn_codebooks
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    uniform = torch.rand(4000, 32, generator=gen) * 2 - 1
    spiky = torch.randn(4000, 32, generator=gen) ** 3
    cb = learn_codebooks([uniform, spiky], bits=2, count=4, max_groups=8000)
    assert cb.dtype == torch.int8 and cb.shape == (4, 4)
    assert bool((cb[:, 1:] > cb[:, :-1]).all())  # sorted, distinct
    inner = (cb[:, 1:3].float().abs().mean(1) / cb[:, [0, 3]].float().abs().mean(1))
    # uniform data: centroids ±1/4, ±3/4 of the absmax (ratio 1/3); cubed Gaussians: a peaked table
    assert inner.max() > 0.3 and inner.min() < 0.25


@pytest.mark.parametrize("fmt,rival", [("gcb2", "int2_g64"), ("gcb3", "int3_g64")])
def test_gcb_beats_int_at_fewer_bits_and_picks_its_best_codebook(fmt, rival):
    from torch_lowbit.formats.gcb import GroupCodebook
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    w = torch.randn(48, 512, generator=gen) * torch.rand(48, 1, generator=gen).add(0.5)
    w[:, ::7] *= 3
    f, r = tl.get_format(fmt), tl.get_format(rival)
    assert f.bits_per_weight() < r.bits_per_weight()
    err = lambda g: float(((g.dequantize(g.quantize(w)) - w) ** 2).sum())  # noqa: E731
    assert err(f) < err(r)
    q = f.quantize(w)
    assert int(q["codebook_index"].max()) < f.table().shape[0] and int(q["sub_scales"].min()) >= 1
    # restricted to its first codebook (a one-table file), the format can only do worse
    import safetensors.torch as st, tempfile, os
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "one.safetensors")
        st.save_file({f"b{f.bits}": f.table()[:4].contiguous()}, path)
        assert err(GroupCodebook(bits=f.bits, codebooks=path)) >= err(f)


def test_gcb_module_checkpoint_and_bad_codebook_files(tmp_path):
    from torch_lowbit.formats.gcb import GroupCodebook
    lin = torch.nn.Linear(512, 48)
    x = torch.randn(3, 512)
    for layout in ("gcb_i8_n16", "gcb_rowmajor"):
        ql = tl.QuantLinear.from_linear(lin, "gcb2", layout=layout if layout == "gcb_rowmajor" else None)
        assert ql.layout.name == layout  # the int8 kernel layout is the CPU default
        assert ql.weight_nbytes() * 8 == pytest.approx(2.3125 * lin.weight.numel() + 16 * 4 * 8)  # + the 16x4 table
        with torch.no_grad():
            torch.testing.assert_close(ql(x), ql.layout.reference_activations(x) @ ql.dequantize().T + lin.bias)
        path = tmp_path / f"{layout}.safetensors"
        tl.save_quantized(torch.nn.Sequential(ql), path)
        back = tl.load_quantized(torch.nn.Sequential(torch.nn.Linear(512, 48)), path)
        assert back[0].layout.name == layout
        torch.testing.assert_close(back[0](x), ql(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="gcb-learn"):
        GroupCodebook(bits=2, codebooks=str(tmp_path / "missing.safetensors")).table()
    with pytest.raises(ValueError, match="bits must be 2 or 3"):
        GroupCodebook(bits=4)
    with pytest.raises(ValueError, match="not divisible by the group size 256"):
        tl.get_format("gcb2").quantize(torch.randn(4, 320))


def test_gcb_kernel_op_rejects_bad_buffers():
    q = tl.QuantLinear.from_linear(torch.nn.Linear(256, 32, bias=False), "gcb3")
    b = dict(q.named_buffers())
    op = torch.ops.torch_lowbit.lut_i8_linear
    x = torch.randn(2, 256)
    args = lambda **kw: {**dict(x=x, qweight=b["qweight"], scales=b["super_scales"], mins=None,
                             lut=b["codebooks"].reshape(-1), code_bits=3, group_size=256, out_features=32, bias=None,
                             sub_groups=b["sub_groups"]), **kw}
    torch.testing.assert_close(op(**args()), q(x))
    with pytest.raises(RuntimeError, match="sub_groups must be uint8"):
        op(**args(sub_groups=b["sub_groups"][:, :4]))
    with pytest.raises(RuntimeError, match="1..16 int8 codebooks of 8 entries"):
        op(**args(lut=torch.zeros(20, dtype=torch.int8)))
    with pytest.raises(RuntimeError, match="take no mins"):
        op(**args(mins=b["super_scales"]))
    with pytest.raises(RuntimeError, match="2- or 3-bit codes"):
        op(**args(code_bits=4, qweight=torch.zeros(2, 8, 256, dtype=torch.uint8)))


def test_int4_pc_binds_one_scale_per_row_to_each_layer(tmp_path):
    """int4_pc (QuaRot's per-channel W4): the registered config is unbound; a layer binds it to its row
    length, checkpoints record the bound config, and a config bound to one width refuses another."""
    f = tl.get_format("int4_pc")
    w = torch.randn(24, 160) * torch.rand(24, 1).add(0.1)
    q = f.quantize(w)
    assert q["scales"].shape == (24, 1) and q["codes"].shape == (24, 160)
    assert ((f.dequantize(q) - w).norm() / w.norm()) < 0.12
    # the scale search beats ggml's signed-max / -8 rule on every row's squared error
    d = w.gather(1, w.abs().argmax(1, keepdim=True)) / -8
    naive = (torch.round(w / d).clamp(-8, 7) * d - w).square().sum(1)
    assert bool(((f.dequantize(q) - w).square().sum(1) <= naive * (1 + 1e-5)).all())
    lin = torch.nn.Linear(160, 24)
    layer = tl.QuantLinear.from_linear(lin, "int4_pc")
    assert layer.fmt.group_size == 160 and layer.fmt.name == "int4_pc" and layer.scales.shape[1] == 1
    with pytest.raises(ValueError, match="bound to rows of 160"):
        layer.fmt.for_layer(192)
    with pytest.raises(ValueError, match="multiple of 32"):
        tl.QuantLinear.from_linear(torch.nn.Linear(100, 8), "int4_pc")
    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(160, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

    model = tl.quantize_(mlp(), "int4_pc", progress=False)
    tl.save_quantized(model, tmp_path / "pc.safetensors")
    loaded = tl.load_quantized(mlp(), tmp_path / "pc.safetensors")
    x = torch.randn(3, 160)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert [m.fmt.group_size for m in loaded.modules() if isinstance(m, tl.QuantLinear)] == [160, 64]


# ---- q5_0 / q5_1 (ggml's Q5_0 / Q5_1; kept out of the registry until a layout holds 5-bit codes) -----

@pytest.mark.parametrize("name", ["q5_0", "q5_1"])
def test_q5_quantizers_give_gguf_codes_and_scales(name):
    """Data-free q5_0 / q5_1 against gguf.quants' transcription of quantize_row_q5_{0,1}_ref, on rows with
    an all-zero block and a +max / -max tie (the first wins, as ggml's strict '<' scan)."""
    gguf = pytest.importorskip("gguf")
    from torch_lowbit.formats.uniform import GGML_Q5
    from torch_lowbit.io.gguf_blocks import decode_blocks
    seed = int(torch.randint(0, 2 ** 31, ()))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(7, 32 * 5, generator=g) * torch.tensor([0.01, 0.1, 1.0, 3.0, 50.0, 0.5, 2.0]).unsqueeze(1)
    w[2, 32:64] = 0.0  # d = 0
    w[3, 70] = w[3, 64:96].abs().max() * 1.5
    w[3, 71] = -w[3, 70]
    fmt = GGML_Q5[name]
    qtype = getattr(gguf.GGMLQuantizationType, name.upper())
    raw = gguf.quants.quantize(w.numpy(), qtype)
    want = decode_blocks(raw, qtype.name)
    got = fmt.quantize(w)
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), f"{name} {k} differs from gguf (seed {seed})"
    assert torch.equal(fmt.dequantize(got), torch.from_numpy(gguf.quants.dequantize(raw, qtype)))


@pytest.mark.parametrize("name", ["q5_0", "q5_1"])
def test_q5_importance_lowers_weighted_error_and_five_bits_beat_four(name):
    from torch_lowbit.formats.uniform import GGML_Q5
    f = GGML_Q5[name]
    w = torch.randn(48, 256) * 0.05
    imp = torch.rand(256) ** 4 * 100
    plain = f.dequantize(f.quantize(w))
    weighted = f.dequantize(f.quantize(w, importance=imp))
    assert int(f.quantize(w, importance=imp)["codes"].max()) <= 31
    err = lambda d: float(((d - w) ** 2 * imp).sum())  # noqa: E731
    assert err(weighted) < err(plain)
    four = tl.get_format("q4_0" if name == "q5_0" else "int4_g32_minmax")
    rel = lambda f_: float((f_.dequantize(f_.quantize(w)) - w).norm() / w.norm())  # noqa: E731
    assert rel(f) < 0.6 * rel(four)  # one more bit: about half the error
