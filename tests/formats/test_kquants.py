"""The K-quant formats q2_k .. q6_k against gguf's numpy dequantizers (ggml's reference, bit for bit),
their quantizers' error, the ggml_k_blocks layout in QuantLinear, and their input checks."""
import numpy as np
import pytest
import torch
from torch import nn

import torch_lowbit as tl
from conftest import assert_matches_product
from torch_lowbit.core.kquant_blocks import BLOCK_BYTES, blocks_to_tensors, tensors_to_blocks
from torch_lowbit.formats.kquants import KQuantFormat

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

KQUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


def gguf_dequantize(raw: torch.Tensor, name: str) -> torch.Tensor:
    out = gguf_quants.dequantize(raw.numpy(), getattr(GGMLQuantizationType, name.upper()))
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(raw.shape[0], -1)


def random_blocks(name: str, rows: int, superblocks: int, gen: torch.Generator) -> torch.Tensor:
    """Random block bytes with finite, nonzero fp16 d (and dmin)."""
    raw = torch.randint(0, 256, (rows, superblocks * BLOCK_BYTES[name]), dtype=torch.uint8, generator=gen)
    q = blocks_to_tensors(name, raw)
    for key in ("d", "dmin"):
        if key in q:
            sign = torch.randint(0, 2, q[key].shape, generator=gen) * 2 - 1
            q[key] = (sign * (torch.rand(q[key].shape, generator=gen) + 0.01) * 0.01).half()
    return tensors_to_blocks(name, q)


def gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    return torch.where(w == 0, torch.full_like(w, 1e-3), w)


def rel_rms(fmt, w, importance=None) -> float:
    f = tl.get_format(fmt)
    return float(((f.dequantize(f.quantize(w, importance)) - w).pow(2).mean() / w.pow(2).mean()).sqrt())


@pytest.mark.parametrize("name", KQUANTS)
def test_block_bytes_round_trip_and_dequantize_equals_gguf(name):
    gen = torch.Generator().manual_seed(9100 + KQUANTS.index(name))
    assert GGML_QUANT_SIZES[getattr(GGMLQuantizationType, name.upper())] == (256, BLOCK_BYTES[name])
    raw = random_blocks(name, 33, 5, gen)
    q = blocks_to_tensors(name, raw)
    f = tl.get_format(name)
    f.check_quantized(q, 33, 1280)
    assert torch.equal(tensors_to_blocks(name, q), raw)
    assert torch.equal(f.dequantize(q), gguf_dequantize(raw, name))
    # every code value and scale occurs in random bytes: the ranges are the struct's whole ranges
    assert int(q["codes"].max()) == (1 << f.code_bits) - 1 and int(q["codes"].min()) == 0
    assert (int(q["sub_scales"].min()), int(q["sub_scales"].max())) == f.scale_range


@pytest.mark.parametrize("name", KQUANTS)
@pytest.mark.parametrize("with_importance", [False, True])
def test_quantized_blocks_dequantize_in_gguf_as_in_the_format(name, with_importance):
    seed = 9200 + 2 * KQUANTS.index(name) + with_importance
    w = gaussian(5, 256 * 3, seed)
    w[:, 5::11] *= 6  # outliers, so scales and mins vary between sub-blocks
    importance = torch.rand(768, generator=torch.Generator().manual_seed(seed)) + 0.05 if with_importance else None
    f = tl.get_format(name)
    q = f.quantize(w, importance)
    f.check_quantized(q, 5, 768)
    raw = tensors_to_blocks(name, q)
    assert torch.equal(gguf_dequantize(raw, name), f.dequantize(q))
    assert torch.equal(blocks_to_tensors(name, raw)["codes"], q["codes"])


def test_error_falls_with_bits_and_q4_k_beats_q4_0():
    w = gaussian(33, 256 * 5, 9300)
    errors = [rel_rms(name, w) for name in KQUANTS]
    assert errors == sorted(errors, reverse=True), errors
    assert errors[2] < rel_rms("q4_0", w)  # q4_k's 6-bit sub-block scales and mins beat q4_0's blocks
    assert errors[0] < 0.35 and errors[-1] < 0.025, errors


@pytest.mark.parametrize("name", KQUANTS)
def test_importance_lowers_the_weighted_error(name):
    w = gaussian(9, 256 * 3, 9400 + KQUANTS.index(name))
    importance = torch.ones(768)
    importance[::3] = 50.0  # a third of the inputs matter far more
    f = tl.get_format(name)

    def weighted(q):
        return float(((f.dequantize(q) - w) ** 2 * importance).sum())

    assert weighted(f.quantize(w, importance)) < weighted(f.quantize(w))


@pytest.mark.parametrize("name", KQUANTS)
def test_gptq_keeps_the_imatrix_parameters_and_lowers_the_output_error(name):
    """GPTQ rounding fixes d, dmin, sub-scales and mins from the imatrix quantizer (the diagonal of the
    Hessian as importance) and re-picks only the codes, feeding each column's error forward: on
    correlated inputs the layer's output error falls below the imatrix quantizer's own codes."""
    from torch_lowbit.calibrate import gptq_quantize
    seed = int(torch.randint(0, 2 ** 31, ()))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 512, generator=g) * 0.05
    x = torch.randn(2048, 64, generator=g) @ torch.randn(64, 512, generator=g) + 0.1 * torch.randn(2048, 512, generator=g)
    h = x.T @ x / x.shape[0]
    f = tl.get_format(name)
    ref = f.quantize(w, torch.diag(h))
    q = gptq_quantize(f, w, h)
    f.check_quantized(q, 24, 512)
    assert all(torch.equal(q[k], ref[k]) for k in ref if k != "codes"), seed

    def output_error(qq):
        return float(((x @ (f.dequantize(qq) - w).T) ** 2).mean())

    assert output_error(q) < output_error(ref), seed


def test_bits_per_weight_and_block_bytes():
    expected = {"q2_k": 2.625, "q3_k": 3.4375, "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625}
    for name, bpw in expected.items():
        f = tl.get_format(name)
        assert isinstance(f, KQuantFormat) and f.group_size == 256 and f.bits_per_weight() == bpw
        assert tl.format_from_json(f.to_json()) == f


@pytest.mark.parametrize("name", ["q3_k", "q4_k"])
def test_bad_inputs_get_clear_errors(name):
    f = tl.get_format(name)
    with pytest.raises(ValueError, match="not a multiple of 256.*q4_0"):
        f.quantize(torch.randn(3, 256 + 32))
    w = gaussian(3, 512, 9500)
    w[1, 17] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        f.quantize(w)
    with pytest.raises(TypeError, match="floating point"):
        f.quantize(torch.randint(1, 4, (3, 512)))
    with pytest.raises(ValueError, match="importance"):
        f.quantize(gaussian(3, 512, 9501), importance=-torch.ones(512))
    q = f.quantize(gaussian(3, 512, 9502))
    f.check_quantized(q, 3, 512)
    with pytest.raises(ValueError, match="codes must lie in 0..7" if name == "q3_k" else "codes must lie in 0..15"):
        f.check_quantized({**q, "codes": q["codes"] | 16}, 3, 512)
    with pytest.raises(ValueError, match="sub_scales must be"):
        f.check_quantized({**q, "sub_scales": q["sub_scales"].float()}, 3, 512)
    with pytest.raises(ValueError, match="d must be torch.float16"):
        f.check_quantized({**q, "d": q["d"].float()}, 3, 512)
    with pytest.raises(ValueError, match="exactly"):
        f.check_quantized({k: v for k, v in q.items() if k != "d"}, 3, 512)
    with pytest.raises(ValueError, match="codes must be"):
        f.check_quantized(q, 3, 768)
    with pytest.raises(ValueError, match="NaN/Inf"):
        f.check_quantized({**q, "d": torch.full_like(q["d"], float("inf"))}, 3, 512)
    if name == "q3_k":
        with pytest.raises(ValueError, match="sub_scales must lie in -32..31"):
            f.check_quantized({**q, "sub_scales": torch.full_like(q["sub_scales"], 40)}, 3, 512)
    with pytest.raises(ValueError, match="block bytes must be uint8"):
        blocks_to_tensors(name, torch.zeros(3, BLOCK_BYTES[name] + 1, dtype=torch.uint8))


@pytest.mark.parametrize("name,layout", [("q4_k", "kquant_i8_n16"), ("q6_k", "kquant_i8_n16"), ("q2_k", "kquant_i8_n16"),
                                         ("q4_k", "ggml_k_blocks"), ("q3_k", "ggml_k_blocks")])
def test_quantize_model_runs_and_round_trips_a_checkpoint(name, layout, tmp_path):
    """The CPU default (kquant_i8_n16: the int8-activation kernels) and the GGUF-bytes layout."""
    torch.manual_seed(9600 + KQUANTS.index(name))
    model = nn.Sequential(nn.Linear(512, 768), nn.ReLU(), nn.Linear(768, 129))
    x = torch.randn(3, 512)
    reference = {}
    for i in (0, 2):
        f = tl.get_format(name)
        reference[i] = f.dequantize(f.quantize(model[i].weight.detach()))
    tl.quantize_(model, name, layout=None if layout == "kquant_i8_n16" else layout)
    for i in (0, 2):
        layer = model[i]
        assert isinstance(layer, tl.QuantLinear) and layer.layout.name == layout
        if layout == "ggml_k_blocks":
            assert layer.blocks.dtype == torch.uint8 and layer.weight_nbytes() == layer.blocks.numel()
        assert torch.equal(layer.dequantize(), reference[i])
    acts = model[0].layout.reference_activations  # int8 per 32 features for the kernels, x itself for the blocks
    h = torch.relu(model[0](x))
    assert_matches_product(model[0](x), acts(x), reference[0], model[0].bias)
    assert_matches_product(model[2](h), acts(h), reference[2], model[2].bias)
    y = model(x)
    tl.save_quantized(model, tmp_path / "m.safetensors")
    skeleton = nn.Sequential(nn.Linear(512, 768), nn.ReLU(), nn.Linear(768, 129))
    tl.load_quantized(skeleton, tmp_path / "m.safetensors")
    assert skeleton[0].layout.name == layout and torch.equal(skeleton(x), y)
    assert all(torch.equal(a, b) for a, b in zip(skeleton[0].packed.values(), model[0].packed.values()))


def test_block_layout_keeps_given_blocks_and_gathers_rows():
    gen = torch.Generator().manual_seed(9700)
    raw = random_blocks("q5_k", 11, 2, gen)
    q = blocks_to_tensors("q5_k", raw)
    layer = tl.QuantLinear.from_quantized("q5_k", q, 11, 512, layout="ggml_k_blocks")
    assert torch.equal(layer.blocks, raw)
    rows = torch.tensor([9, 0, 4])
    for lay in (layer, tl.QuantLinear.from_quantized("q5_k", q, 11, 512)):  # and the CPU tiles (kquant_i8_n16)
        part = lay.layout.gather_rows(lay.fmt, lay.packed, rows)
        assert torch.equal(lay.fmt.dequantize(part), gguf_dequantize(raw, "q5_k")[rows])
    with pytest.raises(ValueError, match="cannot hold"):
        tl.QuantLinear.from_quantized("q4_0", {"codes": torch.zeros(11, 512, dtype=torch.uint8),
                                               "scales": torch.ones(11, 16, dtype=torch.float16)},
                                      11, 512, layout="ggml_k_blocks")


# ---- ggml's C reference quantizers, transcribed loop for loop in fp32 (numpy scalars) -------------

F32 = np.float32


def _nearest_int(v):
    return int(np.rint(F32(v)))


def _make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad):
    n = len(x)
    mn, mx = x[0], x[0]
    sum_w = weights[0]
    sum_x = F32(sum_w * x[0])
    for i in range(1, n):
        mn, mx = min(mn, x[i]), max(mx, x[i])
        sum_w = F32(sum_w + weights[i])
        sum_x = F32(sum_x + F32(weights[i] * x[i]))
    mn = min(mn, F32(0))
    if mx == mn:
        return F32(0), -mn, [0] * n
    iscale = F32(F32(nmax) / F32(mx - mn))
    scale = F32(F32(1) / iscale)
    levels, best = [], F32(0)
    for i in range(n):
        level = max(0, min(nmax, _nearest_int(F32(iscale * F32(x[i] - mn)))))
        levels.append(level)
        diff = F32(F32(F32(scale * level) + mn) - x[i])
        best = F32(best + F32(weights[i] * (abs(diff) if use_mad else F32(diff * diff))))
    for step in range(nstep + 1):
        iscale = F32(F32(F32(F32(rmin) + F32(F32(rdelta) * step)) + nmax) / F32(mx - mn))
        aux, sum_l, sum_l2, sum_xl = [], F32(0), F32(0), F32(0)
        for i in range(n):
            level = max(0, min(nmax, _nearest_int(F32(iscale * F32(x[i] - mn)))))
            aux.append(level)
            w = weights[i]
            sum_l = F32(sum_l + F32(w * level))
            sum_l2 = F32(sum_l2 + F32(F32(w * level) * level))
            sum_xl = F32(sum_xl + F32(F32(w * level) * x[i]))
        det = F32(F32(sum_w * sum_l2) - F32(sum_l * sum_l))
        if det > 0:
            this_scale = F32(F32(F32(sum_w * sum_xl) - F32(sum_x * sum_l)) / det)
            this_min = F32(F32(F32(sum_l2 * sum_x) - F32(sum_l * sum_xl)) / det)
            if this_min > 0:
                this_min, this_scale = F32(0), F32(sum_xl / sum_l2)
            err = F32(0)
            for i in range(n):
                diff = F32(F32(F32(this_scale * aux[i]) + this_min) - x[i])
                err = F32(err + F32(weights[i] * (abs(diff) if use_mad else F32(diff * diff))))
            if err < best:
                levels, best, scale, mn = aux, err, this_scale, this_min
    return scale, -mn, levels


def _q4_k_ref_block(x):
    """quantize_row_q4_K_ref on one super-block: (codes, scales, mins, d, dmin) before packing."""
    scales, mins, levels = [], [], []
    for j in range(8):
        sub = x[32 * j:32 * j + 32]
        sum_x2 = F32(0)
        for v in sub:
            sum_x2 = F32(sum_x2 + F32(v * v))
        av_x = F32(np.sqrt(F32(sum_x2 / F32(32))))
        weights = [F32(av_x + abs(v)) for v in sub]
        s, m, lv = _make_qkx2_quants(sub, weights, 15, -1.0, 0.1, 20, False)
        scales.append(s), mins.append(m), levels.extend(lv)
    max_scale = max([F32(0)] + [s for s in scales if s > 0])
    max_min = max([F32(0)] + [m for m in mins if m > 0])
    inv_scale = F32(F32(63) / max_scale) if max_scale > 0 else F32(0)
    inv_min = F32(F32(63) / max_min) if max_min > 0 else F32(0)
    ls = [min(63, _nearest_int(F32(inv_scale * s)) & 255) for s in scales]
    lm = [min(63, _nearest_int(F32(inv_min * m)) & 255) for m in mins]
    d, dmin = np.float16(F32(max_scale / F32(63))), np.float16(F32(max_min / F32(63)))
    for j in range(8):
        step = F32(F32(d) * ls[j])
        if step == 0:
            continue
        dm = F32(F32(dmin) * lm[j])
        for i in range(32 * j, 32 * j + 32):
            levels[i] = max(0, min(15, _nearest_int(F32(F32(x[i] + dm) / step))))
    return levels, ls, lm, d, dmin


def test_q4_k_quantizer_follows_ggmls_reference_loop_for_loop():
    w = gaussian(3, 256, 9900)
    w[:, 3::13] *= 5
    q = tl.get_format("q4_k").quantize(w)
    for row in range(3):
        codes, ls, lm, d, dmin = _q4_k_ref_block([F32(v) for v in w[row].tolist()])
        assert q["codes"][row].tolist() == codes
        assert q["sub_scales"][row].tolist() == ls and q["sub_mins"][row].tolist() == lm
        assert q["d"][row, 0].item() == float(d) and q["dmin"][row, 0].item() == float(dmin)


def _signed_max(x):
    amax, mx = F32(0), F32(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    return amax, mx


def _make_qx_quants(x, nmax, weights):
    """make_qx_quants(rmse_type 1) with weights x^2 (weights None) or the given ones."""
    n = len(x)
    amax, mx = _signed_max(x)
    if amax < F32(1e-15):
        return F32(0), [0] * n
    w = [F32(v * v) for v in x] if weights is None else weights

    def sums(iscale):
        levels, sumlx, suml2 = [], F32(0), F32(0)
        for i in range(n):
            level = max(-nmax, min(nmax - 1, _nearest_int(F32(iscale * x[i]))))
            levels.append(level + nmax)
            sumlx = F32(sumlx + F32(F32(w[i] * x[i]) * level))
            suml2 = F32(suml2 + F32(F32(w[i] * level) * level))
        return levels, sumlx, suml2

    levels, sumlx, suml2 = sums(F32(F32(-nmax) / mx))
    scale = F32(sumlx / suml2) if suml2 else F32(0)
    best = F32(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        cand, sumlx, suml2 = sums(F32(-F32(nmax + F32(F32(0.1) * step)) / mx))
        if suml2 > 0 and F32(sumlx * sumlx) > F32(best * suml2):
            levels, scale = cand, F32(sumlx / suml2)
            best = F32(scale * sumlx)
    return scale, levels


def _q6_k_ref_block(x):
    """quantize_row_q6_K_ref on one super-block: (codes, int8 scales, d)."""
    scales, levels = [], []
    for j in range(16):
        s, lv = _make_qx_quants(x[16 * j:16 * j + 16], 32, None)
        scales.append(s), levels.extend(lv)
    max_abs, max_scale = _signed_max(scales)
    iscale = F32(F32(-128) / max_scale)
    d = np.float16(F32(F32(1) / iscale))
    sub = [min(127, _nearest_int(F32(iscale * s))) for s in scales]
    for j in range(16):
        step = F32(F32(d) * sub[j])
        if step == 0:
            continue
        for i in range(16 * j, 16 * j + 16):
            levels[i] = max(-32, min(31, _nearest_int(F32(x[i] / step)))) + 32
    return levels, sub, d


def test_q6_k_quantizer_follows_ggmls_reference_loop_for_loop():
    w = gaussian(3, 256, 9910)
    w[:, 5::17] *= 4
    q = tl.get_format("q6_k").quantize(w)
    for row in range(3):
        codes, sub, d = _q6_k_ref_block([F32(v) for v in w[row].tolist()])
        assert q["sub_scales"][row].tolist() == sub and q["d"][row, 0].item() == float(d)
        assert q["codes"][row].tolist() == codes


def _make_qp_quants(x, nmax, w):
    n = len(x)
    mx = F32(0)
    for v in x:
        mx = max(mx, v)
    if mx < F32(1e-15):
        return F32(0), [0] * n
    iscale = F32(F32(nmax) / mx)
    levels = [_nearest_int(F32(iscale * v)) for v in x]
    scale = F32(F32(1) / iscale)
    best = F32(0)
    for i in range(n):
        diff = F32(x[i] - F32(scale * levels[i]))
        best = F32(best + F32(F32(w[i] * diff) * diff))
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = F32(F32(F32(F32(0.1) * step) + nmax) / mx)
        scale_is = F32(F32(1) / iscale_is)
        mse = F32(0)
        for i in range(n):
            level = min(nmax, _nearest_int(F32(iscale_is * x[i])))
            diff = F32(x[i] - F32(scale_is * level))
            mse = F32(mse + F32(F32(w[i] * diff) * diff))
        if mse < best:
            best, iscale = mse, iscale_is
    sumlx, suml2 = F32(0), F32(0)
    for i in range(n):
        levels[i] = min(nmax, _nearest_int(F32(iscale * x[i])))
        sumlx = F32(sumlx + F32(F32(w[i] * x[i]) * levels[i]))
        suml2 = F32(suml2 + F32(F32(w[i] * levels[i]) * levels[i]))
    for _ in range(5):
        changed = 0
        for i in range(n):
            slx = F32(sumlx - F32(F32(w[i] * x[i]) * levels[i]))
            sl2 = F32(suml2 - F32(F32(w[i] * levels[i]) * levels[i]))
            if slx > 0 and sl2 > 0:
                new = min(nmax, _nearest_int(F32(F32(x[i] * sl2) / slx)))
                if new != levels[i]:
                    slx = F32(slx + F32(F32(w[i] * x[i]) * new))
                    sl2 = F32(sl2 + F32(F32(w[i] * new) * new))
                    if F32(F32(slx * slx) * suml2) > F32(F32(sumlx * sumlx) * sl2):
                        levels[i], sumlx, suml2 = new, slx, sl2
                        changed += 1
        if not changed:
            break
    return (F32(sumlx / suml2) if suml2 > 0 else F32(0)), levels


def _q4_k_imatrix_block(x, qw):
    """quantize_row_q4_K_impl on one super-block with quant_weights qw."""
    sum_x2 = F32(0)
    for v in x:
        sum_x2 = F32(sum_x2 + F32(v * v))
    sigma2 = F32(F32(F32(2) * sum_x2) / F32(256))
    scales, mins, sw, levels = [], [], [], []
    for j in range(8):
        sub = x[32 * j:32 * j + 32]
        weights = [F32(qw[32 * j + i] * F32(np.sqrt(np.float64(F32(sigma2 + F32(v * v)))))) for i, v in enumerate(sub)]
        total = F32(0)
        for v in weights:
            total = F32(total + v)
        sw.append(total)
        s, m, lv = _make_qkx2_quants(sub, weights, 15, -0.9, 0.05, 36, False)
        scales.append(s), mins.append(m), levels.extend(lv)
    d_block, ls = _make_qp_quants(scales, 63, sw)
    m_block, lm = _make_qp_quants(mins, 63, sw)
    d, dmin = np.float16(d_block), np.float16(m_block)
    for j in range(8):
        step = F32(F32(d) * ls[j])
        if step == 0:
            continue
        dm = F32(F32(dmin) * lm[j])
        for i in range(32 * j, 32 * j + 32):
            levels[i] = max(0, min(15, _nearest_int(F32(F32(x[i] + dm) / step))))
    return levels, ls, lm, d, dmin


def test_q4_k_imatrix_quantizer_follows_llamacpps_loop_for_loop():
    w = gaussian(3, 256, 9920)
    importance = torch.rand(256, generator=torch.Generator().manual_seed(9921)) * 3 + 0.01
    q = tl.get_format("q4_k").quantize(w, importance)
    qw = [F32(v) for v in importance.tolist()]
    for row in range(3):
        codes, ls, lm, d, dmin = _q4_k_imatrix_block([F32(v) for v in w[row].tolist()], qw)
        assert q["sub_scales"][row].tolist() == ls and q["sub_mins"][row].tolist() == lm
        assert q["d"][row, 0].item() == float(d) and q["dmin"][row, 0].item() == float(dmin)
        assert q["codes"][row].tolist() == codes


def _q2_k_ref_block(x):
    """quantize_row_q2_K_ref on one super-block: (codes, scales, mins, d, dmin)."""
    scales, mins, levels = [], [], []
    for j in range(16):
        sub = x[16 * j:16 * j + 16]
        s, m, lv = _make_qkx2_quants(sub, [abs(v) for v in sub], 3, -0.5, 0.1, 15, True)
        scales.append(s), mins.append(m), levels.extend(lv)
    max_scale = max([F32(0)] + [s for s in scales if s > 0])
    max_min = max([F32(0)] + [m for m in mins if m > 0])
    ls = [_nearest_int(F32(F32(F32(15) / max_scale) * s)) for s in scales] if max_scale > 0 else [0] * 16
    lm = [_nearest_int(F32(F32(F32(15) / max_min) * m)) for m in mins] if max_min > 0 else [0] * 16
    d = np.float16(F32(max_scale / F32(15))) if max_scale > 0 else np.float16(0)
    dmin = np.float16(F32(max_min / F32(15))) if max_min > 0 else np.float16(0)
    for j in range(16):
        step = F32(F32(d) * ls[j])
        if step == 0:
            continue
        dm = F32(F32(dmin) * lm[j])
        for i in range(16 * j, 16 * j + 16):
            levels[i] = max(0, min(3, _nearest_int(F32(F32(x[i] + dm) / step))))
    return levels, ls, lm, d, dmin


def _make_q3_quants(x, nmax):
    n = len(x)
    amax, mx = _signed_max(x)
    if amax < F32(1e-15):
        return F32(0), [0] * n
    iscale = F32(F32(-nmax) / mx)
    w = [F32(v * v) for v in x]
    levels, sumlx, suml2 = [], F32(0), F32(0)
    for i in range(n):
        level = max(-nmax, min(nmax - 1, _nearest_int(F32(iscale * x[i]))))
        levels.append(level)
        sumlx = F32(sumlx + F32(F32(w[i] * x[i]) * level))
        suml2 = F32(suml2 + F32(F32(w[i] * level) * level))
    for _ in range(5):
        changed = 0
        for i in range(n):
            slx = F32(sumlx - F32(F32(w[i] * x[i]) * levels[i]))
            if slx > 0:
                sl2 = F32(suml2 - F32(F32(w[i] * levels[i]) * levels[i]))
                new = max(-nmax, min(nmax - 1, _nearest_int(F32(F32(x[i] * sl2) / slx))))
                if new != levels[i]:
                    slx = F32(slx + F32(F32(w[i] * x[i]) * new))
                    sl2 = F32(sl2 + F32(F32(w[i] * new) * new))
                    if sl2 > 0 and F32(F32(slx * slx) * suml2) > F32(F32(sumlx * sumlx) * sl2):
                        levels[i], sumlx, suml2 = new, slx, sl2
                        changed += 1
        if not changed:
            break
    return (F32(sumlx / suml2) if suml2 > 0 else F32(0)), [v + nmax for v in levels]


def _q3_k_ref_block(x):
    """quantize_row_q3_K_ref on one super-block: (codes, signed scales, d)."""
    scales, levels = [], []
    for j in range(16):
        s, lv = _make_q3_quants(x[16 * j:16 * j + 16], 4)
        scales.append(s), levels.extend(lv)
    _, max_scale = _signed_max(scales)
    iscale = F32(F32(-32) / max_scale)
    sub = [max(-32, min(31, _nearest_int(F32(iscale * s)))) for s in scales]
    d = np.float16(F32(F32(1) / iscale))
    for j in range(16):
        step = F32(F32(d) * sub[j])
        if step == 0:
            continue
        for i in range(16 * j, 16 * j + 16):
            levels[i] = max(-4, min(3, _nearest_int(F32(x[i] / step)))) + 4
    return levels, sub, d


def test_q2_k_and_q3_k_quantizers_follow_ggmls_reference_loop_for_loop():
    w = gaussian(3, 256, 9930)
    w[:, 7::19] *= 5
    q2, q3 = tl.get_format("q2_k").quantize(w), tl.get_format("q3_k").quantize(w)
    for row in range(3):
        x = [F32(v) for v in w[row].tolist()]
        codes, ls, lm, d, dmin = _q2_k_ref_block(x)
        assert q2["sub_scales"][row].tolist() == ls and q2["sub_mins"][row].tolist() == lm
        assert q2["d"][row, 0].item() == float(d) and q2["dmin"][row, 0].item() == float(dmin)
        assert q2["codes"][row].tolist() == codes
        codes, sub, d = _q3_k_ref_block(x)
        assert q3["sub_scales"][row].tolist() == sub and q3["d"][row, 0].item() == float(d)
        assert q3["codes"][row].tolist() == codes
