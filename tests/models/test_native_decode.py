"""The native decoder (csrc/native_decoder.cpp, torch_lowbit/native_decode.py): a whole Llama-family
step in C++ over the quantized buffers, checked against the model's own forward and transformers'
generate on random models of several shapes and formats."""
import pytest
import torch
from torch import nn

import torch_lowbit as tl
from torch_lowbit.native_decode import native_decoder

from conftest import quantized_tiny_llama, tiny_llama

pytestmark = pytest.mark.skipif(not tl.ops.has_cpu_extension(), reason="the native decoder is C++")

# Odd shapes: 5 query heads on 1 KV head, head_dim 32, MLP 224, a vocabulary of 250 (a ragged last tile).
ODD = dict(vocab_size=250, hidden_size=160, intermediate_size=224, num_attention_heads=5, num_key_value_heads=1)


class _Cache:
    """The decoder writes keys and values into `layers[i].keys / .values` (a StaticCache's)."""

    class Layer:
        def __init__(self, shape):
            self.keys, self.values = torch.zeros(shape), torch.zeros(shape)

    def __init__(self, model, batch, length):
        cfg = model.config
        shape = (batch, cfg.num_key_value_heads, length, model.model.layers[0].self_attn.head_dim)
        self.layers = [self.Layer(shape) for _ in range(cfg.num_hidden_layers)]


def _model(fmt, seed, fuse=False, **config):
    torch.manual_seed(seed)
    model = tiny_llama(**config)
    if fmt != "fp32":
        tl.quantize_(model, fmt, progress=False, fuse=fuse)
    return model


def _relative(got, want):
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("fmt, fuse, config", [
    ("q4_0", False, {}),
    ("q4_0", True, ODD),
    ("int4_g32", False, dict(attention_bias=True, mlp_bias=True)),  # mins, biases
    ("int2_g64", True, {}),
    ("q8_0", False, ODD),
    ("gcb2", False, dict(hidden_size=256, intermediate_size=512)),  # group codebooks (superblocks of 256)
    ("q4_k", True, dict(hidden_size=256, intermediate_size=512)),  # K-quants: integer sub-scales of 32, mins
    ("q6_k", False, dict(hidden_size=256, intermediate_size=512)),  # sub-scales of 16, 6-bit codes, an offset
    ("q5_1", False, ODD),  # 5-bit codes with mins
    ("fp32", False, ODD),  # float nn.Linear everywhere
])
def test_steps_match_the_models_forward(fmt, fuse, config):
    seed = torch.seed() % 10_000
    model = _model(fmt, seed, fuse, **config)
    decoder, why = native_decoder(model, 48)
    assert why is None, why
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))
    decoder.bind(_Cache(model, 2, 48))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits.float()
    # prefills of 6 tokens (one dot product per query and key) and of 20 at position 0 and 17 at 20 (torch's
    # SDPA: causal, then masked), then decode steps: each the logits of the model's forward at that position.
    # Float weights: the same math to fp32 rounding. Quantized: the same kernels on the same int8
    # activations, except that about one seed in ten has an activation on a rounding tie, which the
    # last-bit differences of the norms and attention send to the neighbouring code (measured up to
    # 3e-3); a wrong weight, slice or bias is off by O(1).
    tolerance = 1e-5 if fmt == "fp32" else 2e-2
    assert _relative(decoder(ids[:, :6], 0), want[:, 5]) < tolerance, f"seed {seed}"
    assert _relative(decoder(ids[:, :20], 0), want[:, 19]) < tolerance, f"seed {seed}"
    assert _relative(decoder(ids[:, 20:37], 20), want[:, 36]) < tolerance, f"seed {seed}"
    for pos in range(37, 40):
        assert _relative(decoder(ids[:, pos:pos + 1], pos), want[:, pos]) < tolerance, f"seed {seed}, position {pos}"


def _decode_steps(decoder, model, ids, prefill):
    decoder.bind(_Cache(model, ids.shape[0], ids.shape[1] + 2))
    out = [decoder(ids[:, :prefill], 0)]
    return out + [decoder(ids[:, p:p + 1], p) for p in range(prefill, ids.shape[1])]


def test_decode_steps_are_the_same_bytes_when_stalled_workers_lose_their_chunks():
    """Decode steps run on reclaimable pool jobs (csrc/common/parallel.h): the calling thread takes back
    a chunk whose worker stalls, and the worker's late result is thrown away. Workers made to sleep 3 ms
    after every claim (beyond the caller's patience) must change no byte of any step's logits, with an
    oversubscribed pool (6 threads), then on OpenMP. Wide enough layers (a ragged 4001-token head, 5
    query heads on 1 KV head) that the workers claim chunks before the caller has taken them all."""
    import time
    from torch_lowbit.ops import cpu_extension, threads
    ext = cpu_extension()
    seed = torch.seed() % 10_000
    model = _model("q4_0", seed, True, vocab_size=4001, hidden_size=480, intermediate_size=1504,
                   num_attention_heads=5, num_key_value_heads=1)
    tl.quantize_embeddings_(model, "q8_0")
    decoder, why = native_decoder(model, 48)
    assert why is None, why
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(seed))
    before, chosen = (ext.threading(), ext.pool_threads()), dict(threads._chosen)
    try:
        tl.set_num_threads(1)
        want = _decode_steps(decoder, model, ids, 8)
        tl.set_num_threads(6)
        ext.set_reclaim_test_delay_us(3000)
        stats = ext.pool_stats()
        got = _decode_steps(decoder, model, ids, 8)
        ext.set_reclaim_test_delay_us(0)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"seed {seed}"
        for _ in range(200):  # the late workers wake up, find their chunks taken and throw them away
            reclaimed, discarded = (b - a for a, b in zip(stats[3:], ext.pool_stats()[3:]))
            if discarded > 0:
                break
            time.sleep(0.01)
        assert reclaimed > 0 and discarded > 0, (reclaimed, discarded)
        assert all(torch.equal(g, w) for g, w in zip(_decode_steps(decoder, model, ids, 8), want)), f"seed {seed}"
        tl.set_num_threads(scheduler="openmp")
        assert all(torch.equal(g, w) for g, w in zip(_decode_steps(decoder, model, ids, 8), want)), f"seed {seed}"
    finally:
        ext.set_reclaim_test_delay_us(0)
        ext.set_threading(before[0], before[1] if before[0] == "pool" else 0)
        threads._chosen.update(chosen)
    del decoder  # waits for workers still sleeping in a taken chunk


def test_the_head_may_stay_float_while_the_embedding_is_q8_0():
    model = _model("q4_0", 11)
    tl.quantize_embeddings_(model, "q8_0")
    decoder, why = native_decoder(model, 16)
    assert why is None, why


@pytest.mark.parametrize("prompt_len, batch", [(1, 1), (7, 2), (13, 1)])
def test_generator_on_the_native_decoder_equals_transformers_greedy(prompt_len, batch):
    model = quantized_tiny_llama("q4_0", seed=prompt_len)
    ids = torch.randint(0, 256, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
    gen = tl.CompiledGenerator(model, max_cache_len=40)
    got = gen.generate(ids, 10)
    assert gen._native is not None and gen.native_reason is None
    want = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    assert torch.equal(gen.generate(ids, 10), want)  # the cache reused


def test_sampling_on_the_native_decoder_is_reproducible():
    model = quantized_tiny_llama("q4_0", seed=5)
    ids = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(5))
    gen = tl.CompiledGenerator(model, max_cache_len=32, native=True, compile=False)
    run = lambda seed: gen.generate(ids, 8, do_sample=True, temperature=1.5, seed=seed)  # noqa: E731
    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))
    assert torch.equal(gen.generate(ids, 8, do_sample=True, top_k=1, seed=3), gen.generate(ids, 8))


class _OffsetNorm(nn.Module):
    """Gemma's RMSNorm (weight + 1): the structure of Llama's, another computation."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return x * (1.0 + self.weight)


def test_an_architecture_that_only_looks_like_llama_is_refused_by_the_probe():
    model = quantized_tiny_llama("q4_0", seed=2)
    for layer in model.model.layers:
        layer.input_layernorm = _OffsetNorm(layer.input_layernorm)
    decoder, why = native_decoder(model, 16)
    assert decoder is None and "differ from the model's forward" in why
    with pytest.raises(ValueError, match="native=True, but the native decoder cannot run this model"):
        tl.CompiledGenerator(model, max_cache_len=16, compile=False, native=True).generate(torch.tensor([[1, 2]]), 2)


@pytest.mark.parametrize("change, reason", [
    (lambda m: tl.quantize_(m, "nuq3", progress=False), "has no native kernel"),
    (lambda m: m.to(torch.bfloat16), "neither a QuantLinear nor a float32 nn.Linear"),
    (lambda m: setattr(m.config, "hidden_act", "gelu"), "hidden_act 'gelu'"),
    (lambda m: m.model.layers[0].add_module("adapter", nn.Linear(4, 4)), "modules other than"),  # eval dropouts pass
    (lambda m: m.model.layers[1].self_attn.add_module("rope_gate", nn.Identity()), "unknown attention / MLP parts"),
    (lambda m: m.model.layers[1].self_attn.add_module("q_norm", nn.Identity()), "q_norm / k_norm are not both"),
    (lambda m: setattr(m.config, "sliding_window", 8), "sliding-window attention"),
])
def test_models_it_cannot_run_are_named_with_the_reason(change, reason):
    torch.manual_seed(0)
    model = tiny_llama()
    change(model)
    decoder, why = native_decoder(model, 16)
    assert decoder is None and reason in why


def test_children_that_do_nothing_at_inference_are_no_reason_to_refuse():
    torch.manual_seed(0)
    model = tiny_llama()
    model.model.layers[0].add_module("resid_attn_dropout", nn.Dropout(0.1).eval())  # as Phi-3's blocks have
    model.model.layers[1].add_module("noop", nn.Identity())
    decoder, why = native_decoder(model, 16)
    assert decoder is not None, why
    model.model.layers[0].resid_attn_dropout.train()  # a dropout that would drop: refused
    decoder, why = native_decoder(model, 16)
    assert decoder is None and "resid_attn_dropout" in why


def test_a_generator_without_it_uses_the_compiled_route_and_says_why(caplog):
    model = quantized_tiny_llama("nuq3", seed=1)
    ids = torch.tensor([[3, 4, 5]])
    with caplog.at_level("WARNING", logger="torch_lowbit"):
        gen = tl.CompiledGenerator(model, max_cache_len=16, compile=False, native=None)
        gen.generate(ids, 3)
    # compile=False: not asked for, nothing logged
    assert gen._native is None and not any("native decoder" in r.getMessage() for r in caplog.records)
    gen = tl.CompiledGenerator(model, max_cache_len=16, native=None)
    assert gen.native
    with caplog.at_level("WARNING", logger="torch_lowbit"):
        gen._native_decoder(torch.device("cpu"))
    assert "native decoder off" in caplog.text and "has no native kernel" in caplog.text


def test_bad_calls_are_refused():
    model = quantized_tiny_llama("q4_0", seed=3)
    decoder, _ = native_decoder(model, 16)
    decoder.bind(_Cache(model, 1, 16))
    with pytest.raises(RuntimeError, match="exceed the cache"):
        decoder(torch.tensor([[1, 2]]), 15)
    with pytest.raises(RuntimeError, match="batch 2 but the cache holds 1"):
        decoder(torch.tensor([[1], [2]]), 0)
    with pytest.raises(ValueError, match="excludes cuda_graphs and kv_bits"):
        tl.CompiledGenerator(model, native=True, kv_bits=4, kv_group=32)


@pytest.mark.parametrize("fmt, tolerance", [("fp32", 1e-5), ("q4_0", 2e-2)])
def test_every_cpu_path_matches_the_models_forward(fmt, tolerance):
    """Attention has one build per ISA path (the kernels' paths are checked byte for byte elsewhere)."""
    seed = torch.seed() % 10_000
    model = _model(fmt, seed, **ODD)
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits.float()
    for path in tl.ops.cpu_extension().available_cpu_paths():
        with tl.use_backend("cpu", path=path):
            decoder, why = native_decoder(model, 16)
            assert why is None, f"{path}: {why}"
            decoder.bind(_Cache(model, 1, 16))
            assert _relative(decoder(ids[:, :10], 0), want[:, 9]) < tolerance, f"{path}, seed {seed}"
            assert _relative(decoder(ids[:, 10:], 10), want[:, 10]) < tolerance, f"{path}, seed {seed}"


def test_the_decode_step_profile_splits_the_wall_time():
    from torch_lowbit.bench.e2e import native_decode_profile
    model = quantized_tiny_llama("int2_g64", seed=9)
    gen = tl.CompiledGenerator(model, max_cache_len=32)
    ids = torch.randint(0, 256, (1, 5))
    gen.generate(ids, 2)
    parts = native_decode_profile(gen, ids, 9)
    assert set(parts) == {"wall", "projections", "attention", "other C++", "outside C++"}
    inside = parts["projections"] + parts["attention"] + parts["other C++"]
    assert parts["projections"] > 0 and parts["attention"] > 0 and parts["other C++"] > 0
    assert 0 < inside < parts["wall"]
    before = gen._native.core.phase_seconds()
    gen.generate(ids, 3)
    assert gen._native.core.phase_seconds() == before  # profiling is off again


def test_generate_takes_the_native_decoder_and_says_so():
    from torch_lowbit.generate_route import fast_route
    model = quantized_tiny_llama("q4_0", seed=12)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(12))
    assert fast_route(model) is None
    got = tl.generate(model, ids, max_new_tokens=7)
    assert fast_route(model) == "native"
    assert torch.equal(got, model.generate(ids, max_new_tokens=7, min_new_tokens=7, do_sample=False))
    tl.generate(model, ids, max_new_tokens=3, compile=False)
    assert fast_route(model) == "eager"
    tl.generate(model, ids, max_new_tokens=3)
    assert fast_route(model) == "native"  # the first generator again


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int4_g32", "q5_0"])
def test_embedding_rows_looked_up_in_the_decoder_equal_the_modules(fmt):
    model = _model("q4_0", 13, **ODD)
    tl.quantize_embeddings_(model, fmt)
    decoder, why = native_decoder(model, 16)
    assert why is None and decoder.embed_in_core, why
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(13))
    ids[0, 0], ids[1, -1] = 0, model.config.vocab_size - 1  # the first row and the ragged last tile's last
    decoder.bind(_Cache(model, 2, 16))
    with_lookup = decoder(ids, 0)
    decoder.embed_in_core = False  # the module's own lookup, the same floats in
    assert torch.equal(decoder(ids, 0), with_lookup)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        decoder.core.forward_ids(torch.tensor([[model.config.vocab_size]]), 0)


@pytest.mark.parametrize("arch", ["Qwen2", "Qwen3", "Mistral"])
def test_other_llama_family_architectures_generate_transformers_tokens(arch):
    """Qwen2's q/k/v biases, Qwen3's per-head q/k norms, Mistral (its window off)."""
    import transformers
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, **({"head_dim": 32} if arch == "Qwen3" else {}),
        **({"sliding_window": None} if arch == "Mistral" else {}))
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    tl.quantize_(model, "q4_0", progress=False)
    ids = torch.randint(0, 256, (1, 9))
    gen = tl.CompiledGenerator(model, max_cache_len=32)
    got = gen.generate(ids, 8)
    assert gen.native_reason is None and gen._native is not None, gen.native_reason
    assert torch.equal(got, model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False))
