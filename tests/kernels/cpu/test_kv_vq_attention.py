"""kv_vq_attention (csrc/kv_vq_attention.cpp, common/kv_vq.h) over CQ codes: random codes and codebook
planes (not learned) with grouped heads, several query rows, bool / additive / no masks and fully
masked rows, on each path against attention over the dequantized cache; codebooks learned on data
(formats/kv_vq.py) and the op's checks."""
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.formats.kv_vq import (KV_VQ_CONFIGS, dequantize_kv_vq, kv_vq_bits_per_channel, learn_kv_codebooks,
                                        quantize_kv_vq)
from torch_lowbit.ops import cpu_extension
from torch_lowbit.ops.attention import attention_reference, kv_vq_attention

PATHS = ["scalar", "avx2", "avx512"]


def _cache(gen, b, hkv, length, d, vec, entries):
    planes = torch.randn(hkv, d // vec, vec, entries, generator=gen).half()
    k = torch.randint(0, entries, (b, hkv, length, d // vec), generator=gen).to(torch.uint8)
    v = torch.randint(0, entries, (b, hkv, length, d // vec), generator=gen).to(torch.uint8)
    return k, planes, v, (torch.randn(hkv, d // vec, vec, entries, generator=gen)).half()


@pytest.mark.parametrize("vec,entries", [(2, 256), (4, 256), (8, 16), (4, 12)])
@pytest.mark.parametrize("path", PATHS)
def test_kv_vq_attention_matches_attention_on_the_decoded_cache(vec, entries, path):
    if path not in cpu_extension().available_cpu_paths():
        pytest.skip(f"CPU path {path} not available")
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    b, h, hkv, length, d, s = 2, 6, 2, 77, 32, 3
    kc, kp, vc, vp = _cache(gen, b, hkv, length, d, vec, entries)
    q = torch.randn(b, h, s, d, generator=gen)
    keys, values = dequantize_kv_vq(kc, kp), dequantize_kv_vq(vc, vp)
    causal = (torch.arange(length)[None, :] <= (length - s + torch.arange(s))[:, None]).expand(b, 1, s, length)
    additive = torch.randn(b, h, s, length, generator=gen)
    dead = causal.clone()
    dead[1, :, 0] = False  # a row that sees no key: NaN, as softmax over all -inf
    with tl.use_backend("cpu", path=path):
        for mask in (None, causal, additive, dead):
            y = kv_vq_attention(q, kc, kp, vc, vp, mask, d ** -0.5)
            ref = attention_reference(q.double(), keys, values, mask, d ** -0.5, dtype=torch.float64)
            assert y.shape == (b, s, h, d)
            torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5, equal_nan=True)
        y16 = kv_vq_attention(q.bfloat16(), kc, kp, vc, vp, causal, d ** -0.5)
        assert y16.dtype == torch.bfloat16


def test_learned_codebooks_code_the_cache_closely():
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    x = torch.randn(1, 2, 2048, 16, generator=gen) @ torch.randn(16, 16, generator=gen)  # correlated channels
    for name, bound in (("cq4", 0.03), ("cq2", 0.15)):
        planes = learn_kv_codebooks(x, name)
        vec, bits = KV_VQ_CONFIGS[name]
        assert planes.shape == (2, 16 // vec, vec, 2 ** bits) and planes.dtype == torch.float16
        err = ((dequantize_kv_vq(quantize_kv_vq(x, planes), planes) - x) ** 2).sum() / (x ** 2).sum()
        assert err < bound, (name, float(err))
        assert err > 2 ** (-2 * kv_vq_bits_per_channel(name)) / 4  # not absurdly below the rate


def test_kv_vq_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    kc, kp, vc, vp = _cache(gen, 1, 2, 10, 16, 4, 256)
    q = torch.randn(1, 4, 1, 16)
    with pytest.raises(ValueError, match="unknown KV vector quantization"):
        learn_kv_codebooks(torch.randn(1, 2, 10, 16), "cq3")
    with pytest.raises(ValueError, match="multiple of 4"):
        learn_kv_codebooks(torch.randn(1, 2, 10, 18), "cq2")
    with pytest.raises(ValueError, match="KV heads"):
        quantize_kv_vq(torch.randn(1, 3, 10, 16), kp)
    with pytest.raises(RuntimeError, match="not a multiple of KV heads"):
        kv_vq_attention(torch.randn(1, 3, 1, 16), kc, kp, vc, vp, None, 0.25)
    with pytest.raises(RuntimeError, match="head dimension"):
        kv_vq_attention(torch.randn(1, 4, 1, 32), kc, kp, vc, vp, None, 0.25)
    with pytest.raises(RuntimeError, match="v_planes must match"):
        kv_vq_attention(q, kc, kp, vc, vp[:, :2].contiguous(), None, 0.25)


def test_vq_kv_cache_on_a_model():
    from conftest import tiny_llama
    from torch_lowbit.kv_cache import VQKVCache, learn_kv_codebooks_on
    model = tiny_llama()
    batches = [torch.randint(0, 256, (1, 64)) for _ in range(2)]
    books = learn_kv_codebooks_on(model, batches, "cq4", iters=4)
    assert len(books) == model.config.num_hidden_layers
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        ref = model(ids).logits
        cache = VQKVCache(model.config, 32, books)
        y = model(ids, past_key_values=cache, use_cache=True).logits
    assert (y - ref).norm() / ref.norm() < 0.2  # 4 bits per channel on keys and values
    layer = cache.layers[0]
    assert layer.nbytes() > 0 and layer.k_codes.shape[-1] == layer.k_planes.shape[1]
    # attention() over the codes equals attention over the decoded cache
    q = torch.randn(1, model.config.num_attention_heads, 1, layer.k_planes.shape[1] * layer.k_planes.shape[2])
    mask = (torch.arange(32) < 24).view(1, 1, 1, 32)
    keys, values = layer.read()
    torch.testing.assert_close(layer.attention(q, mask), attention_reference(q, keys, values, mask, q.shape[-1] ** -0.5),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="codebook pairs"):
        VQKVCache(model.config, 32, books[:1])
