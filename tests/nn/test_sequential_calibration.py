"""Sequential calibration: each stage's statistics come from the model with every earlier stage
already quantized, equal to a full forward of that partially quantized model."""
import copy

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.calibrate import collect_hessians
from torch_lowbit.calibrate.sequential import decoder_layers, sequential_stats
from torch_lowbit.nn import QuantLinear
from torch_lowbit.nn.quantize import plan_jobs, quantize_job
from torch_lowbit.nn.fusion import job_members
from torch_lowbit.nn.select import select_linears

from conftest import tiny_llama

STAGES = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def _batches(n, seq, vocab=256):
    return [torch.randint(0, vocab, (1, seq)) for _ in range(n)]


def test_stages_in_reading_order_and_float_stats_match_one_pass():
    model = tiny_llama(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                       intermediate_size=160)
    batches = _batches(3, 37)  # ragged length, odd head count, GQA
    targets = select_linears(model)
    reference = collect_hessians(model, batches, targets, progress=False)
    seen = []
    for stage, stats in sequential_stats(model, batches, targets, progress=False):  # nothing quantized
        seen.append(tuple(f.split(".", 3)[3] for f in stage))
        for f in stage:
            torch.testing.assert_close(stats[f], reference[f], rtol=1e-5, atol=1e-6)
    assert seen == list(STAGES) * 3


@pytest.mark.parametrize("fmt,rounding", [("iq4_nl", "gptq"), ("q4_0", "imatrix"), ("int4_g32", "mixed")])
def test_sequential_equals_quantizing_stage_by_stage_on_full_forwards(fmt, rounding):
    model = tiny_llama(num_hidden_layers=2, hidden_size=96, intermediate_size=160, num_attention_heads=6,
                       num_key_value_heads=2)
    batches = _batches(2, 29)
    reference = copy.deepcopy(model)
    tl.quantize_(model, fmt, calibration=batches, rounding=rounding, sequential=True, progress=False)

    # the definition: every stage calibrated by a full forward of the partially quantized model
    plan, jobs, _ = plan_jobs(reference, fmt)
    by_first = {job_members(j)[0]: j for j in jobs}
    from torch_lowbit.nn.quantize import rounding_args
    for layer in range(2):
        for stage in STAGES:
            fqns = [f"model.layers.{layer}.{name}" for name in stage]
            mods = {f: reference.get_submodule(f) for f in fqns}
            full = rounding != "imatrix"
            stats = collect_hessians(reference, batches, mods, diagonal_only=not full, progress=False)
            job = by_first[fqns[0]]
            quantize_job(reference, job, plan[fqns[0]], **rounding_args(rounding, fqns[0], stats))
    got = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    want = {n: m for n, m in reference.named_modules() if isinstance(m, QuantLinear)}
    assert got.keys() == want.keys() and len(got) == 2 * 4  # fused qkv, o, fused gate/up, down
    for name in got:
        torch.testing.assert_close(got[name].dequantize(), want[name].dequantize(), rtol=0, atol=0)


def test_sequential_differs_from_one_pass_after_the_first_stage():
    torch.manual_seed(1)
    model = tiny_llama(num_hidden_layers=3, hidden_size=64, intermediate_size=128)
    batches = _batches(4, 48)
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        want = model(ids).logits
    one_pass, seq = copy.deepcopy(model), copy.deepcopy(model)
    tl.quantize_(one_pass, "int3_g32", calibration=batches, rounding="gptq", progress=False)
    tl.quantize_(seq, "int3_g32", calibration=batches, rounding="gptq", sequential=True, progress=False)
    first = {n: m.dequantize() for n, m in one_pass.named_modules() if isinstance(m, QuantLinear)}
    for name, m in seq.named_modules():
        if isinstance(m, QuantLinear):
            same = torch.equal(m.dequantize(), first[name])
            # the first stage (layer 0's q/k/v) reads the embeddings either way; later ones do not
            assert same == (name.startswith("model.layers.0.self_attn.") and "o_proj" not in name), name


def test_errors():
    model = tiny_llama()
    with pytest.raises(ValueError, match="data-aware rounding"):
        tl.quantize_(model, "q4_0", rounding="rtn", sequential=True)
    flat = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    assert decoder_layers(flat, ["0", "1"]) is None
    with pytest.raises(ValueError, match="stack of decoder layers"):
        tl.quantize_(flat, "q4_0", calibration=[torch.randn(4, 32)], rounding="gptq", sequential=True,
                     filter_fn=lambda m, f: True)


def test_quarot_recipe_calibrates_the_rotated_model_sequentially():
    """QuaRot(sequential=True): the rotated model's weights (down_proj / o_proj behind online
    Hadamards) are GPTQ'd stage by stage, as rotate_ + quantize_(sequential=True) does by hand."""
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    model = tiny_llama(num_hidden_layers=2)
    batches = [torch.randint(0, 256, (1, 24), generator=gen) for _ in range(2)]
    by_hand = copy.deepcopy(model)
    tl.quantize_(model, tl.QuaRot(weights="iq4_nl", acts=None, kv=None, sequential=True), calibration=batches,
                 progress=False)
    tl.rotate_(by_hand, seed=0)
    tl.quantize_(by_hand, "iq4_nl", calibration=batches, rounding="gptq", sequential=True, progress=False)
    got = {n: m.dequantize() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    want = {n: m.dequantize() for n, m in by_hand.named_modules() if isinstance(m, QuantLinear)}
    assert "model.layers.1.mlp.down_proj.linear" in got and got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name
