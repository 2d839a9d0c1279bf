"""Data-free sensitivities by the linearity theorem (torch_lowbit/calibrate/linearity.py) on small
random Llamas: the fitted slope predicts the KL divergence at other noise levels and for several
layers perturbed at once, the block replay gives what the whole forward gives, and the errors."""
import pytest
import torch

from torch_lowbit.calibrate import linearity
from torch_lowbit.calibrate.linearity import (_Replay, _kl, _reference, fit_curve, linearity_sensitivities, loss_curves,
                                              relative_noise, self_generated_tokens, unit_name)

from conftest import tiny_llama


def _model(seed):
    torch.manual_seed(seed)
    return tiny_llama(num_hidden_layers=3, vocab_size=200)


def _perturbed_kl(model, tokens, noise, seed):
    """KL from the clean model with noise[fqn] (relative norms) added to those layers at once."""
    with torch.no_grad():
        ref = _reference(model(tokens).logits)
        gen = torch.Generator().manual_seed(seed)
        saved = {}
        for fqn, t in noise.items():
            w = model.get_submodule(fqn).weight
            saved[fqn] = w.clone()
            w.add_(relative_noise(w, t, gen))
        kl = _kl(ref, model(tokens).logits.float())
        for fqn, w in saved.items():
            model.get_submodule(fqn).weight.copy_(w)
    return kl


def test_self_generated_tokens_are_seeded_samples_from_bos():
    model = _model(1)
    a = self_generated_tokens(model, 3, 20, seed=5)
    assert a.shape == (3, 20) and a.dtype == torch.long
    assert (a[:, 0] == model.config.bos_token_id).all() and int(a.max()) < 200 and int(a.min()) >= 0
    assert torch.equal(a, self_generated_tokens(model, 3, 20, seed=5))
    assert not torch.equal(a, self_generated_tokens(model, 3, 20, seed=6))
    with pytest.raises(ValueError, match="length >= 2"):
        self_generated_tokens(model, 2, 1)


def test_the_slope_predicts_other_noise_levels_and_sums_over_layers():
    seed = torch.randint(0, 2**31, ()).item()
    model = _model(seed % 1000)
    tokens = self_generated_tokens(model, 4, 48, seed=seed)
    layers = ["model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj", "model.layers.2.self_attn.o_proj"]
    a = linearity_sensitivities(model, {f: [f] for f in layers}, tokens=tokens, noise=(0.02, 0.04), seed=seed,
                                progress=False)
    assert all(v > 0 for v in a.values())
    for f in layers:  # another noise draw at another level: KL ~ a t²
        measured = _perturbed_kl(model, tokens, {f: 0.03}, seed + 11)
        assert 0.6 < measured / (a[f] * 0.03 ** 2) < 1.6, (f, measured, a[f])
    together = _perturbed_kl(model, tokens, {f: 0.03 for f in layers}, seed + 12)  # the theorem: additive
    assert 0.6 < together / (sum(a.values()) * 0.03 ** 2) < 1.6


def test_fit_curve_recovers_a_quadratic_and_falls_back_to_the_line():
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    a, c = (torch.rand(2, generator=gen) * torch.tensor([5.0, 40.0])).tolist()
    noise = (0.1, 0.2, 0.3)
    kls = [a * t * t + c * t ** 4 for t in noise]
    assert fit_curve(noise, kls) == pytest.approx((a, c), rel=1e-6)
    slope, zero = fit_curve(noise, kls, "linear")
    t2 = torch.tensor(noise, dtype=torch.float64) ** 2
    assert zero == 0 and slope == pytest.approx(float((torch.tensor(kls, dtype=torch.float64) * t2).sum() /
                                                      (t2 * t2).sum()))
    assert slope > a  # the line through the origin charges the curvature to small errors too
    bending_down = [a * t * t - 20 * t ** 4 for t in noise]
    assert fit_curve(noise, bending_down)[1] == 0 and fit_curve(noise, bending_down) == fit_curve(
        noise, bending_down, "linear")
    assert fit_curve((0.2,), [0.3]) == pytest.approx((0.3 / 0.04, 0.0))  # one level: the line


def test_loss_curves_measure_as_the_sensitivities_do():
    model = _model(6)
    tokens = self_generated_tokens(model, 2, 24, seed=3)
    units = {f: [f] for f in ["model.layers.0.mlp.up_proj", "model.layers.1.self_attn.o_proj"]}
    a = linearity_sensitivities(model, units, tokens=tokens, seed=4, progress=False)
    line = loss_curves(model, units, tokens=tokens, seed=4, fit="linear", progress=False)
    assert {k: v[0] for k, v in line.items()} == pytest.approx(a) and all(v[1] == 0 for v in line.values())
    with pytest.raises(ValueError, match="unknown fit"):
        loss_curves(model, units, tokens=tokens, fit="cubic", progress=False)


def test_replay_from_a_block_matches_the_whole_forward():
    model = _model(3)
    tokens = self_generated_tokens(model, 2, 16)
    replay = _Replay(model, tokens)
    full = replay.clean_logits()
    assert replay.layers is not None
    for i in range(3):
        torch.testing.assert_close(replay.from_block(i), full, rtol=1e-5, atol=1e-5)
    assert replay.block_of("model.layers.2.mlp.up_proj") == 2 and replay.block_of("lm_head") is None
    units = {unit_name(["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]):
             ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"],
             "model.layers.2.mlp.gate_proj": ["model.layers.2.mlp.gate_proj"], "lm_head": ["lm_head"]}
    assert "model.layers.1.self_attn.q_proj+k_proj" in units
    fast = linearity_sensitivities(model, units, tokens=tokens, seed=9, progress=False)

    class NoReplay(_Replay):  # the whole forward for every noise level
        def clean_logits(self):
            self.layers = None
            return self.full()
    orig = linearity._Replay
    linearity._Replay = NoReplay
    try:
        slow = linearity_sensitivities(model, units, tokens=tokens, seed=9, progress=False)
    finally:
        linearity._Replay = orig
    for k in units:
        assert fast[k] == pytest.approx(slow[k], rel=1e-4), k
    before = {k: v.clone() for k, v in model.state_dict().items()}
    linearity_sensitivities(model, units, tokens=tokens, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # weights restored


def test_bad_input_is_named():
    model = _model(4)
    tokens = torch.randint(0, 200, (1, 8))
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        linearity_sensitivities(model, {"a": ["lm_head"]}, tokens=tokens, noise=(0.1, 1.5))
    with pytest.raises(ValueError, match="is not an nn.Linear"):
        linearity_sensitivities(model, {"a": ["model.layers.0.input_layernorm"]}, tokens=tokens)


def test_relative_noise_has_norm_t_on_every_row():
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    w = torch.randn(13, 40, generator=gen) * torch.logspace(-2, 1, 13)[:, None]
    noise = relative_noise(w, 0.07, gen)
    torch.testing.assert_close(noise.norm(dim=1), 0.07 * w.norm(dim=1))
    assert abs(float(noise.norm() / w.norm()) - 0.07) < 1e-6
