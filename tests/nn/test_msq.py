"""Mixed-scheme quantization (torch_lowbit/nn/msq.py) on a small random Llama: plans within the
budget, optimal for their own predicted losses (brute force), never worse than the greedy, through
quantize_ and a checkpoint, and the errors. Candidates are a few formats (each palette one costs a
Gaussian distortion measurement, cached per test session)."""
import itertools
import logging

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.formats import distortion
from torch_lowbit.nn import msq as msq_module
from torch_lowbit.nn import ProjectionSlot
from torch_lowbit.nn.allocate import plan_bpw
from torch_lowbit.nn.msq import MSQ, candidate_set, plan_msq

from conftest import tiny_llama

pytest.importorskip("scipy")

ROTATED = ["tcq2_1mad", "nuq3", "vq2"]
MIXED = ["tcq2_1mad", "nuq3", "int4_g64"]  # int4_g64 is measured on each layer's weight
FAST = dict(sequences=2, length=24)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path_factory.getbasetemp() / "msq-cache"))


def _model(seed=0):
    torch.manual_seed(seed)
    return tiny_llama(num_hidden_layers=2, vocab_size=200)


def test_plan_is_within_budget_fused_groups_share_and_losses_add_up():
    model = _model()
    plan = plan_msq(model, MSQ(MIXED, 3.1, unfuse=False, **FAST), progress=False)
    assert plan.bpw <= 3.1 + 1e-9 and plan_bpw(model, plan.formats) == pytest.approx(plan.bpw)
    assert len(plan.units) == 8  # q+k+v, o, gate+up, down per block
    sens = plan.sensitivities()
    assert set(sens) == set(plan.formats) and all(a > 0 and c >= 0 for a, c in sens.values())
    for u in plan.units:
        assert {plan.formats[f] for f in u.members} == {u.fmt}
        if u.fmt.name == "int4_g64":  # measured on each layer's weight
            d = [distortion.relative_error(u.fmt, model.get_submodule(f).weight) for f in u.members]
        else:  # rotated: the Gaussian distortion
            d = [distortion.gaussian_distortion(u.fmt)] * len(u.members)
        assert u.loss == pytest.approx(sum(sens[f][0] * x + sens[f][1] * x * x for f, x in zip(u.members, d)))
    assert plan.predicted_loss == pytest.approx(sum(u.loss for u in plan.units))
    assert "| block |" in plan.table() and "predicted loss" in plan.table()


def test_exact_plan_is_the_brute_force_optimum_and_never_worse_than_greedy():
    model = _model(1)
    first = plan_msq(model, MSQ(ROTATED, 2.6, unfuse=False, **FAST), progress=False)  # the fused modules
    sens = first.sensitivities()
    by_name = {u.name: u for u in first.units}
    cands = [tl.get_format(f) for f in ROTATED]
    for target in (2.2, 2.6, 2.9):
        exact = plan_msq(model, MSQ(ROTATED, target, sensitivities=sens, unfuse=False), progress=False)
        greedy = plan_msq(model, MSQ(ROTATED, target, solver="greedy", sensitivities=sens, unfuse=False),
                          progress=False)
        assert exact.predicted_loss <= greedy.predicted_loss * (1 + 1e-12) and greedy.bpw <= target + 1e-9
        best = None
        names = list(by_name)
        total = sum(by_name[n].numel for n in names)
        for combo in itertools.product(cands, repeat=len(names)):
            bits = sum(f.bits_per_weight() * by_name[n].numel for f, n in zip(combo, names))
            if bits <= target * total * (1 + 1e-12):
                loss = sum(msq_module._on_curve(sens[m], distortion.gaussian_distortion(f))
                           for f, n in zip(combo, names) for m in by_name[n].members)
                best = loss if best is None else min(best, loss)
        assert exact.predicted_loss == pytest.approx(best, rel=1e-9)


def test_given_sensitivities_are_not_measured_again(monkeypatch):
    model = _model(2)
    plan = plan_msq(model, MSQ(ROTATED, 2.5, **FAST), progress=False)

    def measure(*a, **k):
        raise AssertionError("sensitivities were given")
    monkeypatch.setattr(msq_module, "loss_curves", measure)
    again = plan_msq(model, MSQ(ROTATED, 2.5, sensitivities=plan.sensitivities()), progress=False)
    assert again.formats == plan.formats


def test_the_linear_fit_and_given_numbers_are_the_line_alone():
    model = _model(2)
    quadratic = plan_msq(model, MSQ(ROTATED, 2.5, **FAST), progress=False).sensitivities()
    line = plan_msq(model, MSQ(ROTATED, 2.5, fit="linear", **FAST), progress=False)
    assert all(c == 0 for _, c in line.sensitivities().values())
    assert any(c > 0 for _, c in quadratic.values())  # the KL bends up over t = 0.1 .. 0.3 somewhere
    slopes = {f: a for f, (a, _) in line.sensitivities().items()}  # plain numbers: a alone
    again = plan_msq(model, MSQ(ROTATED, 2.5, sensitivities=slopes), progress=False)
    assert again.formats == line.formats and again.predicted_loss == pytest.approx(line.predicted_loss)
    with pytest.raises(ValueError, match="unknown fit"):
        MSQ(ROTATED, 2.5, fit="cubic")
    with pytest.raises(ValueError, match=r"expected a >= 0 or \(a, c\) >= 0"):
        plan_msq(model, MSQ(ROTATED, 2.5, sensitivities={f: (1.0, -1.0) for f in slopes}), progress=False)


def test_quantize_with_msq_then_save_and_load(tmp_path):
    model = _model(3)
    ref = _model(3)
    spec = MSQ(MIXED, 3.2, **FAST)
    plan = plan_msq(ref, spec, progress=False)
    tl.quantize_(model, spec, progress=False)
    for fqn, fmt in plan.formats.items():
        parent, _, name = fqn.rpartition(".")
        mod = model.get_submodule(fqn)
        if isinstance(mod, ProjectionSlot):  # a slice of the fused module beside it
            mod = model.get_submodule(f"{parent}.{mod.fused_name}")
        assert mod.fmt.name == fmt.name, fqn
    ids = torch.randint(0, 200, (1, 12))
    with torch.no_grad():
        out = model(ids).logits
    path = tmp_path / "msq.safetensors"
    tl.save_quantized(model, path)
    loaded = tl.load_quantized(_model(3), path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, out)


def test_budgets_and_candidates_are_checked(caplog):
    model = _model(4)
    with pytest.raises(ValueError, match=r"raise target_bpw to at least 2\.0000"):
        plan_msq(model, MSQ(ROTATED, 1.5, **FAST), progress=False)
    with pytest.raises(ValueError, match="needs a budget: target_bpw"):
        MSQ(ROTATED)
    with pytest.raises(ValueError, match="unknown loss model"):
        MSQ(ROTATED, 3.0, loss="hessian")
    with pytest.raises(ValueError, match="unknown candidate set"):
        MSQ("pallete", 3.0).formats()
    with pytest.raises(ValueError, match="calibration"):
        plan_msq(model, MSQ(ROTATED, 3.0, loss="fisher"), progress=False)
    # q4_k's 256-weight super-blocks hold no layer here (hidden 128): skipped with a log line
    with caplog.at_level(logging.INFO, logger="torch_lowbit"):
        plan = plan_msq(model, MSQ(["q4_k", "tcq2_1mad", "nuq3"], 2.5, **FAST), progress=False)
    assert "q4_k cannot hold 8 unit(s)" in caplog.text
    assert all(f.name != "q4_k" for f in plan.formats.values())


def test_the_palette_set_is_every_rotated_palette_format():
    names = candidate_set("palette")
    assert {"nuq2", "vq2", "tcq3", "tcq3_1mad", "tcq2.25"} <= set(names)
    assert not any(n.startswith(("q4", "int", "gcb")) for n in names)
    assert all(tl.get_format(n).rotate for n in names)


def test_fisher_loss_model_with_calibration():
    model = _model(5)
    calib = [torch.randint(0, 200, (1, 16)) for _ in range(2)]
    plan = plan_msq(model, MSQ(["int2_g64", "int4_g64"], 3.0, loss="fisher"), calibration=calib, progress=False)
    assert plan.bpw <= 3.0 + 1e-9 and {f.name for f in plan.formats.values()} == {"int2_g64", "int4_g64"}
    assert plan.predicted_loss > 0


def _fake_latency(monkeypatch, per_weight):
    """Latencies from a formula instead of timing: per_weight[format] µs per 1k weights, plus 5 µs a module."""
    seen = []

    def latency(fmt, n, k, m=1, device="cpu"):
        seen.append((fmt.name, n, k, m))
        return (5.0 + per_weight[fmt.name] * n * k / 1000) * 1e-6
    monkeypatch.setattr(msq_module, "layer_latency", latency)
    return seen


def test_latency_budget_trades_loss_for_time(monkeypatch):
    model = _model(6)
    sens = plan_msq(model, MSQ(ROTATED, 2.6, **FAST), progress=False).sensitivities()
    per_weight = {"tcq2_1mad": 1.0, "vq2": 2.0, "nuq3": 3.0}  # the least loss is the slowest here
    seen = _fake_latency(monkeypatch, per_weight)
    roomy = plan_msq(model, MSQ(ROTATED, target_latency_ms=10.0, sensitivities=sens), progress=False)
    assert {f.name for f in roomy.formats.values()} == {"nuq3"}
    assert (ROTATED[0], 128 + 2 * 64, 128, 1) in seen  # the fused q/k/v shape (4 heads, 2 KV heads of 32)
    assert (ROTATED[0], 64, 128, 1) in seen  # and k alone: the unfused alternative
    sizes = [u.numel for u in plan_msq(model, MSQ(ROTATED, 2.6, sensitivities=sens, unfuse=False),
                                       progress=False).units]
    fastest = sum(5.0 + 1.0 * n / 1000 for n in sizes) * 1e-3  # every fused module in tcq2_1mad
    slowest = sum(5.0 + 3.0 * n / 1000 for n in sizes) * 1e-3
    budget = (fastest + slowest) / 2
    mid = plan_msq(model, MSQ(ROTATED, target_latency_ms=budget, sensitivities=sens), progress=False)
    assert mid.latency_ms <= budget * (1 + 1e-9) and mid.latency_ms == pytest.approx(
        sum(u.latency_s for u in mid.units) * 1e3)
    assert roomy.predicted_loss < mid.predicted_loss and len({f.name for f in mid.formats.values()}) > 1
    at_least = plan_msq(model, MSQ(ROTATED, target_latency_ms=fastest * (1 + 1e-9), sensitivities=sens),
                        progress=False)
    assert {f.name for f in at_least.formats.values()} == {"tcq2_1mad"} and len(at_least.units) == len(sizes)
    with pytest.raises(ValueError, match=f"raise target_latency_ms to at least {fastest:.4f}"):
        plan_msq(model, MSQ(ROTATED, target_latency_ms=fastest * 0.99, sensitivities=sens), progress=False)


def test_a_tokens_per_s_budget_is_the_same_latency_budget(monkeypatch):
    model = _model(8)
    sens = plan_msq(model, MSQ(ROTATED, 2.6, **FAST), progress=False).sensitivities()
    _fake_latency(monkeypatch, {"tcq2_1mad": 1.0, "vq2": 2.0, "nuq3": 3.0})
    sizes = [u.numel for u in plan_msq(model, MSQ(ROTATED, 2.6, sensitivities=sens, unfuse=False),
                                       progress=False).units]
    budget = sum(5.0 + 2.0 * n / 1000 for n in sizes) * 1e-3  # ms: between the fastest and the slowest mix
    by_ms = plan_msq(model, MSQ(ROTATED, target_latency_ms=budget, sensitivities=sens), progress=False)
    by_rate = plan_msq(model, MSQ(ROTATED, target_tokens_per_s=1e3 / budget, sensitivities=sens), progress=False)
    assert by_rate.formats == by_ms.formats and len({f.name for f in by_ms.formats.values()}) > 1
    assert by_rate.tokens_per_s >= 1e3 / budget * (1 - 1e-9)
    assert "tokens/s of these layers (target" in by_rate.table()
    batched = MSQ(ROTATED, target_tokens_per_s=1000.0, batch=16)
    assert batched.latency_budget_ms == pytest.approx(16.0)  # 16 tokens per call at 1000 tokens/s
    import dataclasses
    assert dataclasses.replace(batched, target_bpw=3.0).latency_budget_ms == pytest.approx(16.0)
    with pytest.raises(ValueError, match=r"lower target_tokens_per_s to at most \d"):
        plan_msq(model, MSQ(ROTATED, target_tokens_per_s=1e9, sensitivities=sens), progress=False)
    with pytest.raises(ValueError, match="not both"):
        MSQ(ROTATED, target_latency_ms=1.0, target_tokens_per_s=1000.0)
    with pytest.raises(ValueError, match="positive finite"):
        MSQ(ROTATED, target_tokens_per_s=float("inf"))


def test_fusion_is_given_up_where_separate_formats_win(monkeypatch):
    """With every format equally fast and no launch cost, fused and unfused modules cost the same
    time; under a bit budget the unfused alternative can only lower the loss, and the exact program
    finds the layer-by-layer optimum."""
    model = _model(7)
    sens = plan_msq(model, MSQ(ROTATED, 2.6, **FAST), progress=False).sensitivities()

    def latency(fmt, n, k, m=1, device="cpu"):
        return n * k * 1e-9
    monkeypatch.setattr(msq_module, "layer_latency", latency)
    both = plan_msq(model, MSQ(ROTATED, 2.6, target_latency_ms=1.0, sensitivities=sens), progress=False)
    fused_only = plan_msq(model, MSQ(ROTATED, 2.6, sensitivities=sens, unfuse=False), progress=False)
    unfused = plan_msq(model, MSQ(ROTATED, 2.6, sensitivities=sens), fuse=False, progress=False)
    bits_only = plan_msq(model, MSQ(ROTATED, 2.6, sensitivities=sens), progress=False)  # unfuse: the default
    greedy = plan_msq(model, MSQ(ROTATED, 2.6, sensitivities=sens, solver="greedy"), progress=False)
    assert both.bpw <= 2.6 + 1e-9 and bits_only.bpw <= 2.6 + 1e-9 and greedy.bpw <= 2.6 + 1e-9
    assert both.predicted_loss == pytest.approx(unfused.predicted_loss, rel=1e-9)
    assert bits_only.predicted_loss == pytest.approx(unfused.predicted_loss, rel=1e-9)
    assert both.predicted_loss <= fused_only.predicted_loss * (1 + 1e-12)
    assert len(both.units) >= len(fused_only.units) and all(len(u.members) == 1 for u in greedy.units)
    assert bits_only.predicted_loss <= greedy.predicted_loss * (1 + 1e-12)


def test_layer_latency_is_measured_once_and_cached(tmp_path, monkeypatch):
    from torch_lowbit.nn import latency
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path))
    fmt = tl.get_format("int4_g64")
    calls = []
    real = latency.measure
    monkeypatch.setattr(latency, "measure", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = latency.layer_latency(fmt, 96, 128, 1)
    assert first > 0 and latency.layer_latency(fmt, 96, 128, 1) == first and len(calls) == 1
    assert latency.cached_table() == {latency.entry_key(fmt, 96, 128, 1): first}
    assert "threads" in latency.device_key() and latency.device_key().startswith("cpu|")
    with pytest.raises(KeyError, match="bench latency"):
        latency.layer_latency(fmt, 96, 128, 16, measure_missing=False)
    both = latency.layer_latencies(fmt, 96, 128, (1, 16))
    assert both[1] == first and both[16] > 0 and len(calls) == 2  # only M = 16 measured
    with pytest.raises(ValueError, match="cannot hold a 96x48 layer"):
        latency.measure(fmt, 96, 48)
