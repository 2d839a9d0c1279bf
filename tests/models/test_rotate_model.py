"""QuaRot model rotation (torch_lowbit/rotations/model.py): the function is unchanged, the structure is."""
import pytest
import torch

import torch_lowbit as tl
from conftest import tiny_llama
from torch_lowbit.rotations import OnlineHadamardLinear


def _randomize_norms(model, gen):
    """Default RMSNorm scales are all 1, which would make norm folding untested."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.endswith("norm") and hasattr(mod, "weight"):
                mod.weight.copy_(torch.rand(mod.weight.shape, generator=gen, dtype=mod.weight.dtype).add(0.5))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("tied", [False, True])
def test_rotation_keeps_the_function_in_float64(tied):
    """Odd head count with GQA (6 query heads on 3 KV heads), non-power-of-two hidden (192 = 12 * 16)
    and intermediate (320 = 20 * 16) sizes, random norm scales, tied or untied head."""
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    model = tiny_llama(hidden_size=192, intermediate_size=320, num_attention_heads=6, num_key_value_heads=3,
                       tie_word_embeddings=tied).double()
    _randomize_norms(model, gen)
    ids = torch.randint(0, 256, (2, 13), generator=gen)
    before = _logits(model, ids)
    emb_before = model.model.embed_tokens.weight.clone()
    tl.rotate_(model, seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    after = _logits(model, ids)
    assert _relative_error(after, before) <= 1e-6
    assert not torch.allclose(model.model.embed_tokens.weight, emb_before)  # the weights did change
    assert all(torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
               for layer in model.model.layers)
    assert all(type(layer.mlp.down_proj) is OnlineHadamardLinear for layer in model.model.layers)
    assert all(type(layer.self_attn.o_proj) is OnlineHadamardLinear for layer in model.model.layers)
    if tied:
        assert model.lm_head.weight is not model.model.embed_tokens.weight and not model.config.tie_word_embeddings


def test_rotation_spreads_an_outlier_channel():
    """What QuaRot is for: a residual channel 30x larger than the rest becomes incoherent."""
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    model = tiny_llama().double()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 5] *= 30
    ids = torch.randint(0, 256, (1, 9), generator=gen)
    hidden = lambda: model(ids, output_hidden_states=True).hidden_states[0]  # noqa: E731  (embedding output)
    with torch.no_grad():
        peak_before = (hidden().abs().amax(-1) / hidden().abs().mean(-1)).mean()
        tl.rotate_(model, seed=1)
        peak_after = (hidden().abs().amax(-1) / hidden().abs().mean(-1)).mean()
    assert peak_after < peak_before / 3


@pytest.mark.parametrize("online_o_proj", [False, True])
def test_online_o_proj_hadamard_spreads_an_outlier_head(online_o_proj):
    """A head whose values are 40x the others' (the model's function unchanged: o_proj's columns for
    that head shrink by the same factor) stays an outlier block in o_proj's input under the head-wise
    Hadamard alone; the online Hadamard across heads makes that input incoherent."""
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    model = tiny_llama(num_attention_heads=4, num_key_value_heads=4).double()  # head_dim 32
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.v_proj.weight[32:64] *= 40
        attn.o_proj.weight[:, 32:64] /= 40
    ids = torch.randint(0, 256, (1, 11), generator=gen)
    before = _logits(model, ids)
    tl.rotate_(model, seed=3, online_o_proj=online_o_proj)
    assert _relative_error(_logits(model, ids), before) <= 1e-6
    seen = []
    inner = attn.o_proj.linear if online_o_proj else attn.o_proj
    handle = inner.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(ids)
    handle.remove()
    x = seen[0].reshape(-1, seen[0].shape[-1])[1:]  # the first token attends to itself only
    peak = (x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).mean().item()
    assert type(attn.o_proj) is (OnlineHadamardLinear if online_o_proj else torch.nn.Linear)
    # incoherent, a Gaussian-like row of 128: max / rms ~ 2.4-2.7; one 32-channel block carrying
    # almost all the energy: ~ sqrt(128 / 32) x a block's own max / rms, ~ 4-5 (seeds 0-2 of this test)
    assert (peak < 3.5) if online_o_proj else (peak > 3.5), peak


def test_rotated_model_quantizes_and_runs_fp32():
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    model = tiny_llama()
    _randomize_norms(model, gen)
    ids = torch.randint(0, 256, (1, 11), generator=gen)
    reference = _logits(model, ids)
    tl.rotate_(model, seed=3)
    assert _relative_error(_logits(model, ids), reference) <= 1e-4  # fp32 online Hadamard op
    tl.quantize_(model, "q8_0")
    assert isinstance(model.model.layers[0].mlp.down_proj.linear, tl.QuantLinear)
    assert _relative_error(_logits(model, ids), reference) <= 0.05


def test_qwen2_biases_rotate_too():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).eval().double()
    with torch.no_grad():
        for layer in model.model.layers:  # q/k/v carry biases in Qwen2; make them matter
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen, dtype=torch.float64) * 0.1)
    _randomize_norms(model, gen)
    ids = torch.randint(0, 256, (2, 7), generator=gen)
    before = _logits(model, ids)
    tl.rotate_(model, seed=2)
    assert _relative_error(_logits(model, ids), before) <= 1e-6


def test_rotation_rejects_what_it_cannot_handle():
    from transformers import GPT2Config, GPT2LMHeadModel
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported"):
        tl.rotate_(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64)))
    quantized = tiny_llama()
    tl.quantize_(quantized, "q8_0")
    with pytest.raises(ValueError, match="rotate before quantizing"):
        tl.rotate_(quantized)
    rotated = tl.rotate_(tiny_llama())
    with pytest.raises(ValueError, match="already rotated"):
        tl.rotate_(rotated)
    with pytest.raises(ValueError, match="Hadamard"):
        tl.rotate_(tiny_llama(hidden_size=100, num_attention_heads=2, num_key_value_heads=1))


@pytest.mark.parametrize("tied", [False, True])
def test_rotated_quantized_model_saves_loads_and_compiles(tmp_path, tied):
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    model = tiny_llama(tie_word_embeddings=tied)
    _randomize_norms(model, gen)
    tl.rotate_(model, seed=5)
    tl.quantize_(model, "int4_g32")
    ids = torch.randint(0, 256, (1, 10), generator=gen)
    expected = _logits(model, ids)
    tl.save_quantized(model, tmp_path / "r.safetensors")
    loaded = tl.load_quantized(tiny_llama(tie_word_embeddings=tied), tmp_path / "r.safetensors")
    assert type(loaded.model.layers[1].mlp.down_proj) is OnlineHadamardLinear
    assert type(loaded.model.layers[1].self_attn.o_proj) is OnlineHadamardLinear
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    torch.testing.assert_close(_logits(loaded, ids), expected, rtol=0, atol=0)
    torch._dynamo.reset()  # earlier tests compile the same modules: a fresh cache, not their recompile budget
    compiled = torch.compile(loaded, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_down_proj_smoothing_keeps_the_function_and_shrinks_the_outlier_channel():
    """smooth_down_proj_ divides down_proj's input channel j by max|x_j|^alpha (folded into up_proj's
    rows): float64 logits unchanged, before and after rotate_, and a channel made 40x larger than the
    rest ends up much closer to them."""
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    model = tiny_llama(hidden_size=192, intermediate_size=320, num_attention_heads=6, num_key_value_heads=3).double()
    _randomize_norms(model, gen)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[7] *= 40
    calib = [torch.randint(0, 256, (1, 17), generator=gen) for _ in range(3)]
    ids = torch.randint(0, 256, (2, 13), generator=gen)
    before = _logits(model, ids)
    peak = lambda: tl.rotations.smooth.down_proj_input_max(model, calib)[0]  # noqa: E731
    ratio_before = (peak()[7] / peak().median()).item()
    tl.smooth_down_proj_(model, calib, alpha=0.5)
    assert _relative_error(_logits(model, ids), before) <= 1e-9
    assert (peak()[7] / peak().median()).item() < ratio_before / 3
    tl.rotate_(model, seed=2)
    assert _relative_error(_logits(model, ids), before) <= 1e-6
    with pytest.raises(ValueError, match="already rotated"):
        tl.smooth_down_proj_(model, calib)  # after rotate_: too late
    with pytest.raises(ValueError, match="alpha"):
        tl.smooth_down_proj_(tiny_llama(), calib, alpha=1.5)
    with pytest.raises(ValueError, match="calibration"):
        tl.smooth_down_proj_(tiny_llama(), [])
