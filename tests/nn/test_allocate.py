"""Per-layer format allocation (allocate_formats, MixedBits, plans in quantize_) on a small random
Llama: hidden 128 and intermediate 192, so gcb superblocks of 64 hold every layer
(gcb2_sb64: 2.5 bits per weight, gcb3_sb64: 3.5)."""
import subprocess
import sys

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.nn import ProjectionSlot, QuantLinear, mix_summary, quantized_bpw
from torch_lowbit.nn.allocate import plan_bpw
from torch_lowbit.nn.select import select_linears

from conftest import tiny_llama

MIX = ["gcb2_sb64", "gcb3_sb64"]
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _ids(n=1, t=16):
    return torch.randint(0, 256, (n, t))


def _assert_groups_share(plan):
    for fqn, fmt in plan.items():
        parent, _, name = fqn.rpartition(".")
        for group in FUSED:
            if name in group:
                assert {plan[f"{parent}.{n}"] for n in group} == {fmt}, fqn


@pytest.mark.parametrize("target", [2.7, 3.0, 3.3])
def test_budget_respected_close_to_target_and_fused_groups_share(target):
    model = tiny_llama()
    plan = tl.allocate_formats(model, MIX, target, progress=False)
    assert set(plan) == set(select_linears(model))  # every layer but lm_head
    assert {f.name for f in plan.values()} == set(MIX)
    _assert_groups_share(plan)
    achieved = plan_bpw(model, plan)
    total = sum(m.weight.numel() for m in select_linears(model).values())
    largest_unit = 384 * 128  # the biggest unit (fused gate_up) gains 1 bit per weight from gcb2 to gcb3
    assert achieved <= target + 1e-9
    assert target - achieved < largest_unit / total  # the greedy stops only when no upgrade fits
    # unfused: every projection alone, formats may differ inside a group; still within budget
    loose = tl.allocate_formats(model, MIX, target, fuse=False, progress=False)
    assert set(loose) == set(plan) and plan_bpw(model, loose) <= target + 1e-9


def test_sensitive_layers_get_the_3bit_format():
    model = tiny_llama()
    targets = select_linears(model)
    total = sum(m.weight.numel() for m in targets.values())
    down, o = "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"
    with torch.no_grad():
        targets[down].weight.mul_(30)  # large-variance weights
    imp = {f: torch.ones(m.in_features) for f, m in targets.items()}
    imp[o] = imp[o] * 1e4  # large importance
    # budget: the cheapest mix plus room for exactly these two layers' upgrades
    target = 2.5 + (targets[down].weight.numel() + targets[o].weight.numel() + 100) / total
    plan = tl.allocate_formats(model, MIX, target, importance=imp, progress=False)
    assert {f for f, fmt in plan.items() if fmt.name == "gcb3_sb64"} == {o, down}
    # without the importance, the heavy weights alone still win their layer the 3 bits
    plan = tl.allocate_formats(model, MIX, 2.5 + (targets[down].weight.numel() + 100) / total, progress=False)
    assert {f for f, fmt in plan.items() if fmt.name == "gcb3_sb64"} == {down}


def test_more_candidates_and_excluded_candidates():
    model = tiny_llama()
    three = tl.allocate_formats(model, ["int2_g64", "int3_g64", "int4_g64"], 3.2, progress=False)
    assert plan_bpw(model, three) <= 3.2 + 1e-9
    assert len({f.name for f in three.values()}) >= 2
    _assert_groups_share(three)
    # gcb3 (superblock 256) holds none of the 128/192-wide layers: it is excluded for them
    plan = tl.allocate_formats(model, ["gcb2_sb64", "gcb3"], 2.5, progress=False)
    assert {f.name for f in plan.values()} == {"gcb2_sb64"}
    with pytest.raises(ValueError, match="above the most expensive mix"):
        tl.allocate_formats(model, ["gcb2_sb64", "gcb3"], 3.0, progress=False)


def test_plan_through_quantize_fuses_only_equal_formats_and_saves(tmp_path):
    model = tiny_llama()
    ref = tiny_llama()
    ref.load_state_dict(model.state_dict())
    plan = {"model.layers.0.self_attn.q_proj": "gcb3_sb64", "model.layers.0.self_attn.k_proj": "gcb3_sb64",
            "model.layers.0.self_attn.v_proj": "gcb3_sb64",
            "model.layers.0.mlp.gate_proj": "gcb2_sb64", "model.layers.0.mlp.up_proj": "gcb3_sb64",
            "model.layers.1.mlp.down_proj": tl.get_format("int4_g64")}
    tl.quantize_(model, plan, progress=False)
    l0, l1 = model.model.layers
    assert isinstance(l0.self_attn.q_proj, ProjectionSlot) and l0.self_attn.qkv_proj.fmt.name == "gcb3_sb64"
    assert not hasattr(l0.mlp, "gate_up_proj")  # different formats: quantized separately
    assert l0.mlp.gate_proj.fmt.name == "gcb2_sb64" and l0.mlp.up_proj.fmt.name == "gcb3_sb64"
    assert l1.mlp.down_proj.fmt.name == "int4_g64"
    assert type(l0.self_attn.o_proj) is torch.nn.Linear and type(l1.self_attn.q_proj) is torch.nn.Linear
    assert "gcb2_sb64" in mix_summary(model) and "int4_g64" in mix_summary(model)
    ids = _ids()
    with torch.no_grad():
        out, base = model(ids).logits, ref(ids).logits
    assert torch.isfinite(out).all() and (out - base).norm() < 0.5 * base.norm()
    path = tmp_path / "mixed.safetensors"
    tl.save_quantized(model, path)
    loaded = tl.load_quantized(tiny_llama(), path)
    assert loaded.model.layers[0].mlp.up_proj.fmt.name == "gcb3_sb64"
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, out)


@pytest.mark.parametrize("sensitivity", [None, "output"])
def test_mixed_bits_in_quantize_reads_calibration_once_and_matches_the_allocator(sensitivity):
    base = tiny_llama()
    calib = [_ids(1, 32) for _ in range(3)]
    plan = tl.allocate_formats(base, MIX, 3.0, calibration=calib, sensitivity=sensitivity, progress=False)
    model = tiny_llama()
    model.load_state_dict(base.state_dict())
    calls = []
    hook = model.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    tl.quantize_(model, tl.MixedBits(MIX, 3.0, sensitivity), calibration=iter(calib), progress=False)
    hook.remove()
    # E[x²] once for allocation and rounding; the default ("fisher") adds one forward + backward pass
    assert len(calls) == len(calib) * (2 if sensitivity is None else 1)
    got = {}
    for fqn, m in model.named_modules():
        if isinstance(m, QuantLinear):
            got[fqn] = m.fmt
    for fqn, fmt in plan.items():
        parent, _, name = fqn.rpartition(".")
        fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                 "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}.get(name, name)
        assert got[f"{parent}.{fused}"] == fmt, fqn
    assert 2.5 < quantized_bpw(model) <= 3.0 + 1e-9
    assert "bits per weight" in mix_summary(model)
    with torch.no_grad():
        assert torch.isfinite(model(_ids()).logits).all()


def test_fisher_is_the_mean_squared_loss_gradient_and_leaves_the_model_as_it_was():
    from torch_lowbit.calibrate import collect_fisher
    model = tiny_llama()
    model.model.norm.weight.requires_grad_(False)
    batches = [_ids(1, 24) for _ in range(2)]
    mods = {"model.layers.1.mlp.down_proj": model.model.layers[1].mlp.down_proj}
    fisher = collect_fisher(model, batches, mods, progress=False)
    assert all(p.grad is None for p in model.parameters())
    assert not model.model.norm.weight.requires_grad and model.model.embed_tokens.weight.requires_grad
    want = 0
    for ids in batches:
        model.zero_grad()
        logits = model(ids).logits
        torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
        want = want + mods["model.layers.1.mlp.down_proj"].weight.grad ** 2 / len(batches)
    torch.testing.assert_close(fisher["model.layers.1.mlp.down_proj"], want)


def test_bad_inputs_raise_with_the_fix():
    model = tiny_llama()
    with pytest.raises(ValueError, match="unknown format 'gcb5'"):
        tl.allocate_formats(model, ["gcb2_sb64", "gcb5"], 3.0)
    with pytest.raises(ValueError, match="no candidate formats"):
        tl.allocate_formats(model, [], 3.0)
    with pytest.raises(ValueError, match="list of format names"):
        tl.allocate_formats(model, "gcb2_sb64", 3.0)
    with pytest.raises(ValueError, match="below the cheapest possible mix.*raise target_bpw"):
        tl.allocate_formats(model, MIX, 2.0)
    with pytest.raises(ValueError, match="above the most expensive mix.*gcb3_sb64"):
        tl.allocate_formats(model, MIX, 4.0)
    with pytest.raises(ValueError, match="positive number"):
        tl.allocate_formats(model, MIX, -1)
    with pytest.raises(ValueError, match="can hold 14 layer.*skip_incompatible"):
        tl.allocate_formats(model, ["gcb2", "gcb3"], 3.0)  # superblock 256 > every in_features here
    odd = tiny_llama(intermediate_size=160)  # down_proj in_features 160: no superblock of 64 divides it
    with pytest.raises(ValueError, match="down_proj.*skip_incompatible"):
        tl.allocate_formats(odd, MIX, 3.0)
    plan = tl.allocate_formats(odd, MIX, 3.0, skip_incompatible=True, progress=False)
    assert plan and not any(f.endswith("down_proj") for f in plan)
    with pytest.raises(ValueError, match="needs calibration"):
        tl.quantize_(model, tl.MixedBits(MIX, 3.0), rounding="gptq")

    def never_read():
        raise AssertionError("calibration read before the cheap checks")
        yield

    with pytest.raises(ValueError, match="above the most expensive mix"):  # checked before calibrating
        tl.quantize_(model, tl.MixedBits(MIX, 3.6), calibration=never_read(), progress=False)
    with pytest.raises(ValueError, match="sensitivity='fisher' needs calibration"):
        tl.allocate_formats(model, MIX, 3.0, sensitivity="fisher")
    with pytest.raises(ValueError, match="unknown sensitivity 'hessian'"):
        tl.allocate_formats(model, MIX, 3.0, sensitivity="hessian")
    with pytest.raises(ValueError, match="not an nn.Linear"):
        tl.quantize_(model, {"model.layers.0.mlp": "gcb2_sb64"})
    with pytest.raises(ValueError, match="'nope', which is no module"):
        tl.quantize_(model, {"nope": "gcb2_sb64"})
    with pytest.raises(ValueError, match="unknown format"):
        tl.quantize_(model, {"model.layers.0.mlp.down_proj": "gcb9"})
    with pytest.raises(ValueError, match=r"mixed plan cannot hold 1 layer.*\(gcb2\).*skip_incompatible"):
        tl.quantize_(model, {"model.layers.0.mlp.down_proj": "gcb2"})


def test_cli_mix_needs_a_target():
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "eval", "--mix", "gcb2_sb192", "gcb3_sb192"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--mix needs --target-bpw" in r.stderr


def test_cli_quantize_step_prints_the_mix(capsys):
    import argparse

    from torch_lowbit import cli
    args = argparse.Namespace(mix=MIX, target_bpw=3.0, sensitivity=None, format="q4_0", rounding="rtn", calib=0,
                              ctx=16, skip_incompatible=False, include_lm_head=False)
    model = cli._quantize(tiny_llama(), None, args)
    out = capsys.readouterr().out
    assert "sensitivity: data-free weight error" in out and "| gate_up_proj |" in out
    assert f"{quantized_bpw(model):.4f} bits per weight" in out and quantized_bpw(model) <= 3.0
    assert cli._format_label(args) == "mix gcb2_sb64+gcb3_sb64 @ 3.0 bpw"
    args.mix, args.msq = ["int2_g64", "int4_g64"], True
    model = cli._quantize(tiny_llama(), None, args)
    out = capsys.readouterr().out
    assert "MSQ, data-free linearity-theorem sensitivities, exact solver" in out and "| gate_up_proj |" in out
    assert quantized_bpw(model) <= 3.0 and cli._format_label(args) == "MSQ over int2_g64+int4_g64 @ 3.0 bpw"
    args.target_latency_ms = 50.0
    assert cli._format_label(args) == "MSQ over int2_g64+int4_g64 @ 3.0 bpw + 50.0 ms"
