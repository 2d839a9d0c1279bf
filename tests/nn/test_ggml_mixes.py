"""llama.cpp's K-quant mixes as quantize_ plans (nn/ggml_mixes.py): which layers get more bits, the head,
and the fallbacks of widths that are not whole 256-weight super-blocks."""
import pytest

from torch_lowbit.nn import ggml_mix_plan

from conftest import tiny_llama

# Layers of a 16-layer model (Llama-3.2-1B's depth) whose attn_v and ffn_down llama.cpp's Q4_K_M makes
# Q6_K: the first and last two, and every third from the third on (as the published Q4_K_M files of
# that model show).
MORE_BITS_16 = {0, 1, 4, 7, 10, 13, 14, 15}


def _llama16(hidden=256, intermediate=512):
    import torch
    with torch.device("meta"):
        return tiny_llama(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=16,
                          num_attention_heads=4, num_key_value_heads=1)


def test_q4_k_m_gives_attn_v_and_ffn_down_q6_k_in_llama_cpps_layers_and_the_head_q6_k():
    plan = ggml_mix_plan(_llama16(), "q4_k_m")
    for i in range(16):
        more = "q6_k" if i in MORE_BITS_16 else "q4_k"
        layer = f"model.layers.{i}"
        assert plan[f"{layer}.self_attn.v_proj"] == more and plan[f"{layer}.mlp.down_proj"] == more, i
        for other in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert plan[f"{layer}.{other}"] == "q4_k"
    assert plan["lm_head"] == "q6_k"
    assert len(plan) == 16 * 7 + 1


def test_other_mixes_and_fallbacks_for_widths_off_the_super_block():
    q3 = ggml_mix_plan(_llama16(), "q3_k_m")
    assert [q3[f"model.layers.{i}.self_attn.v_proj"] for i in range(3)] == ["q5_k", "q5_k", "q4_k"]
    assert q3["model.layers.0.mlp.down_proj"] == "q5_k" and q3["model.layers.5.mlp.down_proj"] == "q4_k"
    assert q3["model.layers.3.self_attn.o_proj"] == "q4_k" and q3["model.layers.3.mlp.up_proj"] == "q3_k"
    q2 = ggml_mix_plan(_llama16(), "q2_k")  # 4 heads on 1 KV head: n_gqa 4 -> attn_v q4_k
    assert q2["model.layers.9.self_attn.v_proj"] == "q4_k" and q2["model.layers.9.mlp.down_proj"] == "q3_k"
    assert q2["model.layers.9.self_attn.q_proj"] == "q2_k"
    odd = ggml_mix_plan(_llama16(576, 1536), "q4_k_m")  # SmolLM2's widths: 576 is not whole super-blocks
    assert odd["model.layers.2.self_attn.q_proj"] == "q5_0"  # q4_k -> q5_0
    assert odd["model.layers.0.self_attn.v_proj"] == "q8_0"  # q6_k -> q8_0
    assert odd["model.layers.0.mlp.down_proj"] == "q6_k" and odd["model.layers.2.mlp.down_proj"] == "q4_k"  # 1536
    assert odd["lm_head"] == "q8_0"


def test_bad_mix_requests_are_clear_errors():
    with pytest.raises(ValueError, match="unknown llama.cpp mix 'q4_k_x'"):
        ggml_mix_plan(_llama16(), "q4_k_x")
    import torch
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ggml_mix_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), "q4_k_m")


def test_quantize_takes_a_mix_by_name():
    import torch

    import torch_lowbit as tl
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    model = tiny_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2)
    plan = ggml_mix_plan(model, "q4_k_m")
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        reference = model(ids).logits
    import copy
    q4_0 = tl.quantize_(copy.deepcopy(model), "q4_0", include_lm_head=True, progress=False)
    tl.quantize_(model, "q4_k_m", progress=False)
    got = {fqn: m.fmt.name for fqn, m in model.named_modules() if isinstance(m, tl.QuantLinear)}
    assert got["lm_head"] == "q6_k" and got["model.layers.3.self_attn.v_proj"] == "q6_k"  # 8 layers: 0, 3, 6, 7
    assert got["model.layers.2.mlp.down_proj"] == "q4_k" and got["model.layers.7.mlp.down_proj"] == "q6_k"
    for fqn, fmt in got.items():  # fused q/k/v or gate/up only where the plan gives one format
        assert all(plan[m] == fmt for m in plan if m.startswith(fqn.rsplit(".", 1)[0]) and m.rsplit(".", 1)[-1]
                   in {"q_proj", "k_proj", "v_proj"} | {"gate_proj", "up_proj"} and fqn.endswith(("qkv_proj", "gate_up_proj")))
    with torch.no_grad(), tl.use_backend("reference"):  # float activations for both: the weights' error alone
        err = ((model(ids).logits - reference).norm() / reference.norm()).item()
        err_q4_0 = ((q4_0(ids).logits - reference).norm() / reference.norm()).item()
    assert err < err_q4_0, (err, err_q4_0)  # ggml's search and the Q6_K layers beat q4_0 at a similar size
