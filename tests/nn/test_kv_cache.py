"""The quantized KV cache (torch_lowbit/formats/kv.py math, torch_lowbit/kv_cache.py Cache). Its
attention kernels: tests/kernels/cpu/test_attention.py, tests/kernels/triton/test_triton_kv_attention.py."""
import pytest
import torch

import torch_lowbit as tl
from conftest import tiny_llama
from torch_lowbit.formats.kv import dequantize_kv, quantize_kv


def _gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 32), (8, 64), (4, 10)])
def test_kv_round_trip_is_within_half_a_step(bits, group):
    gen = _gen()
    d = 2 * group if group != 10 else 30
    x = torch.randn(3, 5, 7, d, generator=gen) * torch.rand(3, 5, 7, 1, generator=gen).add(0.2) + 0.3
    codes, scale, mn = quantize_kv(x, bits, group)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == d * bits // 8 and scale.shape[-1] == d // group
    y = dequantize_kv(codes, scale, mn, bits)
    step = scale.float().repeat_interleave(group, -1)
    # fp16 rounding of the min moves the grid by at most half an fp16 ulp of it: allow a little slack
    assert ((y - x).abs() <= step / 2 + 1e-3 * x.abs().amax()).all()
    # the group's extremes are (nearly) representable: min and max land within a step
    xg = x.reshape(*x.shape[:-1], -1, group)
    yg = y.reshape(xg.shape)
    assert ((yg.amin(-1) - xg.amin(-1)).abs() <= scale.float() / 2 + 1e-3).all()


def test_kv_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize_kv(torch.randn(2, 64), 3, 64)
    with pytest.raises(ValueError, match="divisor of the head dimension"):
        quantize_kv(torch.randn(2, 48), 4, 64)
    with pytest.raises(ValueError, match="divisor"):
        tl.QuantizedKVCache(tiny_llama().config, 16, group=128)


def _logits(model, ids, cache):
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=True).logits


def test_cache_with_everything_recent_is_exact_and_rounded_cache_is_close():
    gen = _gen()
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 13), generator=gen)
    from transformers import StaticCache
    ref = _logits(model, ids, StaticCache(config=model.config, max_cache_len=20))
    exact = _logits(model, ids, tl.QuantizedKVCache(model.config, 20, group=32, residual_length=20))
    torch.testing.assert_close(exact, ref, rtol=1e-5, atol=1e-5)
    errors = {}
    for bits in (8, 4):
        for rotate in (False, True):
            out = _logits(model, ids, tl.QuantizedKVCache(model.config, 20, bits=bits, group=32, residual_length=0,
                                                          rotate_keys=rotate))
            errors[bits, rotate] = ((out - ref).norm() / ref.norm()).item()
    assert 0 < errors[8, True] < errors[4, True] < 0.1
    assert 0 < errors[8, False] < errors[4, False] < 0.1


def test_rotating_keys_spreads_an_outlier_channel():
    """A RoPE'd key with one huge channel wastes a 4-bit group; the Hadamard rotation fixes that."""
    gen = _gen()
    k = torch.randn(1, 2, 40, 32, generator=gen)
    k[..., 5] *= 40
    layer = tl.QuantizedKVLayer(40, bits=4, group=32, residual_length=0, rotate_keys=False)
    rotated = tl.QuantizedKVLayer(40, bits=4, group=32, residual_length=0, rotate_keys=True)
    plain_keys, _ = layer.update(k, k)
    rot_keys, _ = rotated.update(k, k)
    assert (rot_keys - k).norm() < 0.5 * (plain_keys - k).norm()


def test_beam_reorder_permutes_the_batch_in_place():
    """reorder_cache (beam search) permutes codes, scales and the exact ring in the same buffers a
    compiled decode graph captured, and reads back what the reordered batch stored."""
    gen = _gen()
    k, v = torch.randn(3, 2, 9, 32, generator=gen), torch.randn(3, 2, 9, 32, generator=gen)
    layer = tl.QuantizedKVLayer(12, bits=4, group=16, residual_length=4)
    ref = tl.QuantizedKVLayer(12, bits=4, group=16, residual_length=4)
    beams = torch.tensor([2, 0, 0])
    layer.update(k, v)
    ref.update(k[beams], v[beams])
    before = {n: t.data_ptr() for n, t in (*layer.key_store.items(), *layer.value_store.items())}
    layer.reorder_cache(beams)
    assert {n: t.data_ptr() for n, t in (*layer.key_store.items(), *layer.value_store.items())} == before
    for got, want in zip(layer.read(), ref.read()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_decode_steps_keep_recent_tokens_exact_and_ragged_lengths_work():
    gen = _gen()
    layer = tl.QuantizedKVLayer(23, bits=4, group=16, residual_length=5)
    k_all = torch.randn(1, 3, 23, 32, generator=gen)
    v_all = torch.randn(1, 3, 23, 32, generator=gen)
    chunks = [7, 1, 1, 6, 1, 1, 1]  # prefill, decodes, another chunk longer than the ring
    start = 0
    for n in chunks:
        keys, values = layer.update(k_all[:, :, start:start + n], v_all[:, :, start:start + n])
        start += n
        assert int(layer.cumulative_length) == start
        torch.testing.assert_close(keys[:, :, start - 5:start], k_all[:, :, start - 5:start])
        torch.testing.assert_close(values[:, :, start - 5:start], v_all[:, :, start - 5:start])
        older = slice(0, start - 5)
        assert 0 < (keys[:, :, older] - k_all[:, :, older]).abs().max() < 0.6
    layer.reset()
    assert int(layer.cumulative_length) == 0 and layer.key_store["codes"].abs().sum() == 0


def test_memory_of_a_4bit_cache_is_under_a_third_of_fp32():
    model = tiny_llama(num_attention_heads=2, num_key_value_heads=2)  # head_dim 64
    cache = tl.QuantizedKVCache(model.config, 4096, bits=4, group=64, residual_length=0)
    cache.early_initialization(1, 2, 64, torch.float32, "cpu")
    fp32 = 2 * 2 * 2 * 4096 * 64 * 4  # layers x (K, V) x heads x tokens x head_dim x bytes
    assert cache.nbytes() <= 0.3 * fp32
    assert cache.nbytes() == 4096 * cache.bytes_per_token(2)


def test_compiled_generation_with_a_4bit_cache_matches_eager():
    """The prefill and the decode steps run the kv_attention kernel on the codes (bound to the
    attention modules while generating): the same tokens as transformers' eager attention over the
    dequantized cache (the reference), eager or compiled, with every token rounded or the last 4 exact."""
    gen = _gen()
    model = tl.rotate_(tiny_llama(), seed=3)
    ids = torch.randint(0, 256, (2, 9), generator=gen)
    reference = tl.CompiledGenerator(model, max_cache_len=24, compile=False, attn_implementation="eager",
                                     kv_bits=4, kv_group=32, kv_residual=0)
    eager = tl.CompiledGenerator(model, max_cache_len=24, compile=False, kv_bits=4, kv_group=32, kv_residual=0)
    compiled = tl.CompiledGenerator(model, max_cache_len=24, kv_bits=4, kv_group=32, kv_residual=0)
    out = reference.generate(ids, 6)
    calls = []
    kernel_route = tl.QuantizedKVLayer.attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tl.QuantizedKVLayer, "attention", lambda self, *a: calls.append(1) or kernel_route(self, *a))
        assert torch.equal(eager.generate(ids, 6), out)
    assert len(calls) == 6 * 2  # the prefill and 5 decode steps x 2 layers
    assert torch.equal(compiled.generate(ids, 6), out)
    assert isinstance(compiled._cache, tl.QuantizedKVCache)
    assert not any(hasattr(m, "_lowbit_kv_layer") for m in model.modules())  # unbound after generating
    ring_reference = tl.CompiledGenerator(model, max_cache_len=24, compile=False, attn_implementation="eager",
                                          kv_bits=4, kv_group=32, kv_residual=4)
    ring = tl.CompiledGenerator(model, max_cache_len=24, compile=False, kv_bits=4, kv_group=32, kv_residual=4)
    assert torch.equal(ring.generate(ids, 6), ring_reference.generate(ids, 6))  # the kernel reads the exact ring
