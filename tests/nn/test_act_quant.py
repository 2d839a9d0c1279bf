"""Per-token activation quantization (torch_lowbit/core/activations.py rounding, torch_lowbit/nn/act_quant.py
ActQuantLinear) and its use with rotate_. The CPU kernel's integer activations:
tests/kernels/cpu/test_int_act.py."""
import copy

import pytest
import torch

import torch_lowbit as tl
from conftest import tiny_llama
from torch_lowbit.core.activations import fake_quantize_per_token, search_clip_ratio


def _gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())


@pytest.mark.parametrize("bits", [8, 4, 3])
def test_symmetric_values_lie_on_the_token_grid(bits):
    x = torch.randn(7, 93, generator=_gen()) * torch.rand(7, 1, generator=_gen()).add(0.1)
    y = fake_quantize_per_token(x, bits)
    qmax = 2 ** (bits - 1) - 1
    d = x.abs().amax(-1, keepdim=True) / qmax
    codes = y / d
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= qmax + 1e-4
    assert ((y - x).abs() <= d / 2 + 1e-6).all()  # no clipping at ratio 1: half a step at most


@pytest.mark.parametrize("bits", [8, 4])
def test_asymmetric_grid_covers_min_to_max(bits):
    x = torch.rand(5, 64, generator=_gen()) * 3 + 1  # all positive: asymmetric wastes no codes
    y = fake_quantize_per_token(x, bits, symmetric=False)
    d = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / (2 ** bits - 1)
    assert ((y - x).abs() <= d / 2 + 1e-5).all()
    assert (fake_quantize_per_token(x, bits) - x).abs().mean() > (y - x).abs().mean()


def _varied_blocks(m, k, block, gen):
    """Activations whose blocks of `block` features have very different scales."""
    return torch.randn(m, k, generator=gen) * torch.rand(m, k // block, 1, generator=gen).add(0.05).repeat_interleave(
        block, 1).reshape(m, k)


def test_blocks_of_32_give_each_block_its_own_grid():
    """block 32: one scale per block of a token's features (MXINT4-style), else the per-token math."""
    x = _varied_blocks(5, 96, 32, _gen())
    y = fake_quantize_per_token(x, 4, block=32)
    for b in range(3):
        cols = slice(b * 32, (b + 1) * 32)
        torch.testing.assert_close(y[:, cols], fake_quantize_per_token(x[:, cols], 4))
    assert (y - x).square().sum() < (fake_quantize_per_token(x, 4) - x).square().sum()


def _sub_block_reference(x, bits, clip, sub):
    """quantize_sub_blocks written out element by element in numpy float32 (an independent twin)."""
    import numpy as np
    qmax = 2 ** (bits - 1) - 1
    kmax, ratio = 127 // (qmax + 1), np.float32(clip / qmax)
    rows = x.numpy().astype(np.float32)
    codes, scales = np.zeros(rows.shape, np.int8), np.zeros((rows.shape[0], rows.shape[1] // 32), np.float32)
    for m, row in enumerate(rows):
        for b in range(rows.shape[1] // 32):
            blk = row[b * 32:(b + 1) * 32]
            s = [np.float32(np.abs(blk[j:j + sub]).max()) * ratio for j in range(0, 32, sub)]
            smax = max(s)
            d, ks, best = np.float32(1), [1] * len(s), np.inf
            for kb in range(kmax, kmax // 2, -1) if smax > 0 else ():
                dc = smax / np.float32(kb)
                kc = [min(max(np.round(sj / dc), 1), kmax) for sj in s]  # np.round: half to even
                worst = max(abs(np.float32(k) * dc - sj) / sj if sj > 0 else np.float32(0) for k, sj in zip(kc, s))
                if worst < best:
                    d, ks, best = dc, kc, worst
            for j, k in enumerate(ks):
                c = np.clip(np.round(blk[j * sub:(j + 1) * sub] / (np.float32(k) * d)), -qmax - 1, qmax)
                codes[m, b * 32 + j * sub:b * 32 + (j + 1) * sub] = c * k
            scales[m, b] = d
    return torch.from_numpy(codes), torch.from_numpy(scales)


@pytest.mark.parametrize("bits,sub", [(4, 16), (3, 16), (4, 8), (2, 8)])
def test_sub_blocks_share_a_32_block_scale_times_integer_multipliers(bits, sub):
    """blocks of 16 / 8: the codes are k_j * c with one fp32 scale per 32 features (two-level scales, so
    the per-32 int8 kernels take them exactly), equal to an element-wise twin; each sub-block's grid is
    the best fraction of its block's, so the error is near per-sub-block scales and below blocks of 32."""
    from torch_lowbit.core.activations import quantize_sub_blocks, sub_block_multiplier_max
    gen = _gen()
    x = _varied_blocks(6, 160, sub, gen)
    x[1, 32:64] = 0  # a zero block: scale 1, codes 0
    x[2, 40:48] = 0  # a zero sub-block beside a live one
    codes, d = quantize_sub_blocks(x, bits, 0.9, sub)
    ref_codes, ref_d = _sub_block_reference(x, bits, 0.9, sub)
    assert torch.equal(codes, ref_codes) and torch.equal(d, ref_d)
    qmax, kmax = 2 ** (bits - 1) - 1, sub_block_multiplier_max(bits)
    assert codes.abs().max() <= (qmax + 1) * kmax <= 127 and d[1, 1] == 1 and (codes[1, 32:64] == 0).all()
    y = fake_quantize_per_token(x, bits, clip_ratio=0.9, block=sub)
    torch.testing.assert_close(y, (codes.float().reshape(6, 5, 32) * d[..., None]).reshape(6, 160))
    free = fake_quantize_per_token(x.reshape(6, -1, sub), bits, clip_ratio=0.9).reshape(6, 160)  # a scale per sub-block
    err = lambda t: (t - x).square().sum()  # noqa: E731
    assert err(y) < err(fake_quantize_per_token(x, bits, clip_ratio=0.9, block=32)) and err(y) < 1.5 * err(free)


@pytest.mark.parametrize("block", [16, 32])
def test_block_scaled_activations_wrap_a_layer(block):
    x = _varied_blocks(5, 96, block, _gen())
    lin = tl.QuantLinear.from_linear(torch.nn.Linear(96, 24), "q4_0")
    wrapped = tl.ActQuantLinear(lin, 4, clip_ratio=0.9, block=block)  # rounded in the kernel
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), lin(fake_quantize_per_token(x, 4, True, 0.9, block)), rtol=0.02, atol=0.02)
        in_torch = tl.ActQuantLinear(tl.QuantLinear.from_linear(torch.nn.Linear(96, 24), "q4_0", layout="lut4_rowmajor"),
                                     4, clip_ratio=0.9, block=block)  # a layout without integer activations
        assert in_torch.layer.forward_int_acts(x, 4, 0.9, block) is None
        for layer in (wrapped, in_torch):  # the kernel route and the torch rounding compile whole
            torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x), layer(x), rtol=1e-5, atol=1e-5)
    assert f"per block of {block}" in repr(wrapped)
    with pytest.raises(ValueError, match="does not divide the layer's 96"):
        tl.ActQuantLinear(lin, 4, block=64)
    with pytest.raises(ValueError, match="16 or 8 .* or a multiple of 32"):
        fake_quantize_per_token(x, 4, block=24)
    with pytest.raises(ValueError, match="blocks of 16 need at most 4 bits"):
        tl.ActQuantLinear(lin, 8, block=16)


def test_clip_search_clips_heavy_tails_only():
    gen = _gen()
    heavy = torch.distributions.StudentT(2.0).sample((256, 128))
    assert search_clip_ratio(heavy, 4) < 1.0
    flat = torch.rand(256, 128, generator=gen) * 2 - 1
    assert search_clip_ratio(flat, 8) == 1.0


def test_quantize_activations_wraps_layers_and_keeps_the_head():
    gen = _gen()
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 9), generator=gen)
    with torch.no_grad():
        ref = model(ids).logits
        tl.quantize_activations_(model, 8, calibration=[ids])
        out = model(ids).logits
    wrapped = [m for m in model.modules() if isinstance(m, tl.ActQuantLinear)]
    assert len(wrapped) == 2 * 7 and type(model.lm_head) is torch.nn.Linear
    assert all(0.5 <= m.clip_ratio <= 1.0 for m in wrapped)
    assert ((out - ref).abs().max() / ref.abs().max()) < 0.05
    with pytest.raises(ValueError, match="already quantized"):
        tl.quantize_activations_(model, 8)
    with pytest.raises(ValueError, match="bits must be"):
        tl.quantize_activations_(tiny_llama(), 5)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, fullgraph=True)(ids).logits, out, rtol=1e-4, atol=1e-4)


def test_rotation_rescues_4bit_activations_from_an_outlier_channel():
    """QuaRot's point on a toy: one residual channel 50x the rest ruins per-token A4; after rotate_
    the same A4 quantization costs several times less."""
    gen = _gen()
    base = tiny_llama().double()
    with torch.no_grad():
        base.model.embed_tokens.weight[:, 11] *= 50
    ids = torch.randint(0, 256, (2, 12), generator=gen)
    import copy
    with torch.no_grad():
        ref = base(ids).logits
        plain = tl.quantize_activations_(copy.deepcopy(base), 4)
        rotated = tl.quantize_activations_(tl.rotate_(copy.deepcopy(base), seed=7), 4)
        err_plain = (plain(ids).logits - ref).pow(2).mean()
        err_rotated = (rotated(ids).logits - ref).pow(2).mean()
    assert err_rotated < err_plain / 3


def test_fused_projections_see_the_same_quantized_input_as_separate_ones():
    """quantize_ fuses q/k/v and gate/up; wrapping the fused module must give the unfused result."""
    gen = _gen()
    import copy
    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 11), generator=gen)
    fused = tl.quantize_(copy.deepcopy(model), "q4_0", progress=False)
    separate = tl.quantize_(copy.deepcopy(model), "q4_0", fuse=False, progress=False)
    with torch.no_grad():
        tl.quantize_activations_(fused, 4, clip_ratio=0.9)
        tl.quantize_activations_(separate, 4, clip_ratio=0.9)
        torch.testing.assert_close(fused(ids).logits, separate(ids).logits, rtol=1e-4, atol=1e-4)


def test_quarot_recipe_takes_per_channel_int4_weights():
    """QuaRot(weights="int4_pc"): GPTQ per-channel W4 on the rotated model, per-token A8 in the kernel."""
    gen = _gen()
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    with torch.no_grad():
        ref = model(ids).logits
        q = tl.quantize_(copy.deepcopy(model), tl.QuaRot(weights="int4_pc", acts=8, kv=None), calibration=[ids],
                         progress=False)
        layers = [m for m in q.modules() if isinstance(m, tl.QuantLinear)]
        assert layers and all(m.fmt.name == "int4_pc" and m.scales.shape[1] == 1 for m in layers)
        out = q(ids).logits
    assert ((out - ref).norm() / ref.norm()) < 0.2


@pytest.mark.parametrize("block", [0, 16])
def test_weights_quantized_after_the_wrapper_still_reach_the_integer_kernel(block, monkeypatch):
    """Activations wrapped first, weights quantized after (quantize_ replaces the wrapped nn.Linear):
    the wrapper still hands x to the QuantLinear's integer-activation route, the same result as
    wrapping a QuantLinear."""
    from torch_lowbit.nn import QuantLinear
    gen = _gen()
    lin = torch.nn.Linear(96, 40)
    model = torch.nn.Sequential(copy.deepcopy(lin))
    tl.quantize_activations_(model, 4, clip_ratio=0.9, block=block, filter_fn=lambda m, f: True)
    tl.quantize_(model, "q4_0", filter_fn=lambda m, f: True, progress=False)
    assert isinstance(model[0].layer, QuantLinear)
    calls = []
    original = QuantLinear.forward_int_acts
    monkeypatch.setattr(QuantLinear, "forward_int_acts", lambda self, *a: calls.append(a[1:]) or original(self, *a))
    x = torch.randn(5, 96, generator=gen)
    with torch.no_grad():
        y = model(x)
        want = tl.ActQuantLinear(QuantLinear.from_linear(lin, "q4_0"), 4, clip_ratio=0.9, block=block)(x)
    assert calls and calls[0] == (4, 0.9, block)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
