"""General VQ formats (gvq*, aqlm_*, gptvq2): k-means / residual codebooks, scopes, exact storage, the
frequency reorder of the layout, LDLQ, the whole foundation (quantize_, compile, save/load) and bad
input. Kernels against the reference: tests/test_reference_harness.py (every registered gvq name)."""
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.formats.gvq import GeneralVQ, beam_search, decode_vectors, kmeans, region_index
from torch_lowbit.layouts.gvq import reorder_by_frequency_in

from conftest import tiny_llama


def nmse(fmt, w, q=None):
    q = fmt.quantize(w) if q is None else q
    return float(((fmt.dequantize(q) - w) ** 2).sum() / (w ** 2).sum())


def test_names_and_exact_storage():
    assert {"aqlm_1x16", "aqlm_2x8", "gptvq2", "gvq4x8", "gvq2x8", "gvq4x8r2"} <= set(tl.formats())
    a = tl.get_format("aqlm_2x8")
    assert (a.vec, a.entries_log2, a.residuals, a.codebook_scope) == (8, 8, 2, "tensor")
    n, k = 4096, 4096
    # codes 2 x 8 bits per 8 weights, two fp16 codebooks of 256 x 8, fp16 row scales
    assert a.storage_bits(n, k) == n * k * 2 + 2 * 256 * 8 * 16 + 16 * n
    g = tl.get_format("gptvq2")  # one 256-entry 4-D fp16 codebook per 256 x 256 tile
    assert g.bits_per_weight() == 2 + 256 * 4 * 16 / 65536
    assert g.storage_bits(300, 512) == 300 * 512 * 2 + 2 * 2 * 256 * 4 * 16 + 16 * 300  # ragged row tile
    assert GeneralVQ(vec=4, entries_log2=8, codebook_scope="channel-group:64").name == "gvq4x8_cg64"
    assert GeneralVQ(vec=2, entries_log2=10, residuals=2, codebook_scope="tile:64x32", rotate=True).name == \
        "gvq2x10r2_t64x32_had"
    q = tl.get_format("gvq4x8r2").quantize(torch.randn(33, 64))
    m = tl.QuantLinear.from_quantized("gvq4x8r2", q, 33, 64)
    stored = sum(t.numel() * t.element_size() * 8 for t in m.packed.values())
    assert stored == tl.get_format("gvq4x8r2").storage_bits(33, 64)  # every byte the layout keeps is counted


def test_distortion_on_a_gaussian_near_the_rate_distortion_bound():
    w = torch.randn(256, 1024)
    for name, bound in (("gvq4x8", 0.100), ("aqlm_2x8", 0.095), ("gvq2x8", 0.0105), ("gvq4x8r2", 0.0105)):
        err = nmse(tl.get_format(name), w)
        rate = tl.get_format(name).code_bits_per_weight
        assert 2 ** (-2 * rate) <= err <= bound, (name, err)
    # residual stages and beam search pay: 2 x 8 bits per 8 weights beats a greedy residual search
    greedy = GeneralVQ(vec=8, entries_log2=8, residuals=2, beam=1, refine_iters=0)
    assert nmse(tl.get_format("aqlm_2x8"), w) < nmse(greedy, w)


def test_kmeans_and_beam_search_basics():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2000, 4)
    book = kmeans(x, None, 16, 10, gen)
    codes = beam_search(x, None, book[None], 4)
    assert codes.shape == (2000, 1) and int(codes.max()) < 16
    d = ((x[:, None] - book[None]) ** 2).sum(-1)
    assert torch.equal(codes[:, 0], d.argmin(1))  # the nearest entry
    few = x[:5]
    assert torch.equal(kmeans(few, None, 16, 10, gen)[:5], few)  # fewer vectors than entries: exact
    # importance weights move the centroids toward the heavy coordinates' values
    wt = torch.ones_like(x)
    wt[:, 0] = 100.0
    err = lambda b, w: float((w * (x - b[beam_search(x, w, b[None], 1)[:, 0]]) ** 2).sum())  # noqa: E731
    assert err(kmeans(x, wt, 16, 10, gen), wt) < err(book, wt)


@pytest.mark.parametrize("scope", ["tensor", "tile:16x32", "channel-group:16"])
def test_scopes_decode_each_region_with_its_codebook(scope):
    f = GeneralVQ(vec=4, entries_log2=4, codebook_scope=scope, kmeans_iters=4)
    w = torch.randn(37, 96)
    q = f.quantize(w)
    assert q["codebooks"].shape[0] == f.regions(37, 96)
    # brute force: every vector decoded from its own region's table
    region = region_index(*f.scope, 37, 96, torch.arange(37), torch.arange(24) * 4)
    dense = torch.stack([torch.stack([q["codebooks"][region[n, j], 0, q["codes"][n, j, 0]].float()
                                      for j in range(24)]).reshape(-1) for n in range(37)])
    assert torch.equal(decode_vectors(q["codes"], q["codebooks"], *f.scope), dense)
    assert torch.equal(f.dequantize(q), dense * q["row_scales"].float()[:, None])
    assert nmse(f, w, q) < 0.4  # 1 bit per weight: the Gaussian bound is 0.25, 4-D VQ ~0.33


def test_layout_reorders_entries_by_use_without_changing_the_weight():
    f = tl.get_format("aqlm_2x8")
    w = torch.randn(64, 256)
    q = f.quantize(w)
    m = tl.QuantLinear.from_quantized(f, q, 64, 256)
    assert m.layout.name == "gvq_rowmajor"
    assert torch.equal(m.dequantize(), f.dequantize(q))  # bit for bit
    unpacked = m.layout.unpack(f, m.packed, 64, 256)
    codes = unpacked["codes"]
    for r in range(2):
        counts = torch.bincount(codes[..., r].reshape(-1).long(), minlength=256)
        assert bool((counts[:-1] >= counts[1:]).all())  # entry 0 the most used
    region = torch.zeros(64, 32, dtype=torch.long)
    c2, b2 = reorder_by_frequency_in(codes, unpacked["codebooks"], region)
    assert torch.equal(c2, codes) and torch.equal(b2, unpacked["codebooks"])  # sorted already: a fixed point


def test_rotation_and_importance():
    w = torch.randn(48, 128)
    plain, rotated = GeneralVQ(vec=4, entries_log2=6), GeneralVQ(vec=4, entries_log2=6, rotate=True)
    assert nmse(rotated, w) < 0.2  # 1.5 bits per weight (Gaussian bound 0.125): the rotation is undone
    m = tl.QuantLinear.from_weights([w], [None], rotated)
    x = torch.randn(3, 128)
    torch.testing.assert_close(m(x), x @ m.dequantize().T, rtol=1e-4, atol=1e-4)  # x rotated online
    imp = torch.ones(128)
    imp[:8] = 50.0
    weighted_err = lambda q: float((imp * (plain.dequantize(q) - w) ** 2).sum())  # noqa: E731
    assert weighted_err(plain.quantize(w, imp)) < weighted_err(plain.quantize(w))


@pytest.mark.parametrize("fmt", ["gvq4x8", "aqlm_2x8", "gptvq2"])
def test_ldlq_lowers_output_error_over_rtn(fmt):
    from torch_lowbit.calibrate.ldlq import ldlq_quantize
    f = tl.get_format(fmt)
    # 16k vectors: on far fewer the codebooks fit the weights themselves and RTN is near exact
    w = torch.randn(128, 512) * 0.05
    x = torch.randn(2048, 512) @ (torch.randn(512, 512) * 0.14 + torch.eye(512))
    h = x.T @ x / x.shape[0]
    out_err = lambda q: float(((x @ (f.dequantize(q) - w).T) ** 2).mean())  # noqa: E731
    rtn, ldlq = f.quantize(w), ldlq_quantize(f, w, h)
    assert set(ldlq) == set(rtn) and all(ldlq[k].shape == rtn[k].shape for k in rtn)
    assert out_err(ldlq) < 0.9 * out_err(rtn), (out_err(ldlq), out_err(rtn))


def test_codebook_tuning_lowers_the_hessian_error():
    import dataclasses
    from torch_lowbit.calibrate.ldlq import ldlq_quantize
    w = torch.randn(64, 256) * 0.05
    x = torch.randn(2048, 256) @ (torch.randn(256, 256) * 0.14 + torch.eye(256))
    h = x.T @ x / x.shape[0]
    tuned = tl.get_format("gvq4x8_had")
    plain = dataclasses.replace(tuned, tune_steps=0)
    out_err = lambda q: float(((x @ (tuned.dequantize(q) - w).T) ** 2).mean())  # noqa: E731
    a, b = ldlq_quantize(plain, w, h), ldlq_quantize(tuned, w, h)
    assert torch.equal(a["codes"], b["codes"])  # the codes are LDLQ's; only codebooks and scales move
    assert out_err(b) < 0.97 * out_err(a), (out_err(b), out_err(a))


@pytest.mark.parametrize("fmt", ["gvq4x8", "aqlm_2x8"])
def test_quantize_model_compile_and_checkpoint(tmp_path, fmt):
    model = tiny_llama()
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        ref = model(x).logits
    tl.quantize_(model, fmt)
    fused = model.model.layers[0].self_attn.qkv_proj
    assert fused.fmt.name == fmt and fused.layout.name == "gvq_rowmajor"
    with torch.no_grad():
        y = model(x).logits
    assert (y - ref).norm() / ref.norm() < 0.7
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x).logits, y, rtol=1e-4, atol=1e-4)
    path = tmp_path / "m.safetensors"
    tl.save_quantized(model, path)
    loaded = tl.load_quantized(tiny_llama(), path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, y)


def test_gptq_rounding_through_quantize_():
    model = tiny_llama()
    calib = [torch.randint(0, 256, (2, 16)) for _ in range(2)]
    tl.quantize_(model, "gvq4x8", calibration=calib, rounding="gptq")
    assert model.model.layers[0].mlp.down_proj.fmt.name == "gvq4x8"


def test_bad_inputs_are_rejected_clearly():
    with pytest.raises(ValueError, match="vec must be"):
        GeneralVQ(vec=3)
    with pytest.raises(ValueError, match="entries_log2"):
        GeneralVQ(entries_log2=17)
    with pytest.raises(ValueError, match="residuals"):
        GeneralVQ(residuals=3)
    with pytest.raises(ValueError, match="codebook_scope"):
        GeneralVQ(codebook_scope="rows:4")
    with pytest.raises(ValueError, match="multiple of vec"):
        GeneralVQ(vec=8, codebook_scope="tile:16x12")
    with pytest.raises(ValueError, match="multiple of the vector size"):
        tl.get_format("gvq4x8").quantize(torch.randn(8, 66))
    with pytest.raises(ValueError, match="Hadamard"):
        GeneralVQ(rotate=True).quantize(torch.randn(8, 100))
    w = torch.randn(8, 64)
    w[1, 2] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        tl.get_format("gvq4x8").quantize(w)
    # codebooks of another configuration (a file of another shape) and codes beyond the table
    q = tl.get_format("gvq4x8").quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="codebooks must have shape"):
        tl.QuantLinear.from_quantized("gvq4x8", dict(q, codebooks=q["codebooks"][..., :2]), 8, 64)
    with pytest.raises(ValueError, match="codes must have shape"):
        tl.QuantLinear.from_quantized("gvq2x8", q, 8, 64)
    bad = dict(q, codes=q["codes"] + 256)
    with pytest.raises(ValueError, match="codes must be integers"):
        tl.QuantLinear.from_quantized("gvq4x8", bad, 8, 64)
    m = tl.QuantLinear.from_quantized("gvq4x8", q, 8, 64)
    with pytest.raises(RuntimeError, match="codebook regions"):
        torch.ops.torch_lowbit.gvq_linear(torch.randn(1, 64), m.codes, 8, m.codebooks.repeat(2, 1, 1, 1), 0, 0,
                                          m.row_scales, None)
