"""The attention ops' CPU kernels (csrc/kv_attention.cpp, csrc/attention.cpp): kv_attention over a
quantized KV cache's codes on each ISA path against float64 attention over the dequantized cache
(decode and causal prefill blocks, grouped-query heads), and gqa_attention over float K/V against
transformers' repeat_kv + softmax. The cache itself: tests/nn/test_kv_cache.py."""
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.ops.attention import attention_reference

SEED_FILE = "test_kv_cache.py"  # split out of tests/test_kv_cache.py: its seeds (conftest.stable_seed)


def _gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())


def _reference_attention(q, keys, values, mask, scale):
    return attention_reference(q, keys, values, mask, scale, dtype=torch.float64)


@pytest.mark.parametrize("path", ["scalar", "avx2"])
@pytest.mark.parametrize("bits,group,d", [(4, 64, 64), (4, 16, 48), (8, 32, 96), (4, 6, 24)])
@pytest.mark.parametrize("rows,residual,g", [(1, 0, 2), (3, 0, 2), (1, 5, 2), (23, 3, 2), (9, 0, 24), (16, 0, 5),
                                            (11, 2, 5)])
def test_kv_attention_kernel_matches_the_dequantized_reference(path, bits, group, d, rows, residual, g):
    """Decode (1 row) and prefill blocks (several rows, causal: the first rows do not see the last
    keys; tasks of several rows x G queries, the last block ragged; 24 heads per KV head leave room
    for only 2 rows per task; 5 heads give 30-40 queries per task: the AVX2 prefill path's query
    lanes in register tiles of 3, 2 and 1 vectors, the last vector partly padding)."""
    from torch_lowbit.ops import cpu_extension
    if path not in cpu_extension().available_cpu_paths():
        pytest.skip(f"CPU path {path} not available")
    gen = _gen()
    b, hkv, length = 2, 3, 37
    rotate = bits == 4  # keys Hadamard-rotated (query rotated by attention()) and plain, both through the kernel
    layer = tl.QuantizedKVLayer(length, bits=bits, group=group, residual_length=residual, rotate_keys=rotate)
    filled = 29  # ragged: the last positions of the static cache stay empty and masked
    layer.update(torch.randn(b, hkv, filled, d, generator=gen) * 2, torch.randn(b, hkv, filled, d, generator=gen))
    keys, values = layer.update(torch.randn(b, hkv, 1, d, generator=gen), torch.randn(b, hkv, 1, d, generator=gen))
    q = torch.randn(b, hkv * g, rows, d, generator=gen)
    last = filled + 1 - rows + torch.arange(rows)  # row s sees keys up to filled + 1 - rows + s (causal)
    mask = torch.arange(length)[None, :] <= last[:, None]
    mask = mask.expand(b, 1, rows, length).clone()
    mask[1, 0, :, 3] = False  # a hole in one sequence
    ref = _reference_attention(q, keys, values, mask, 0.125)
    with tl.use_backend("cpu", path=path):
        out = layer.attention(q, mask, 0.125)
    assert out.shape == (b, rows, hkv * g, d)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    additive = torch.where(mask, 0.0, float("-inf"))
    finfo_min = torch.where(mask, 0.0, torch.finfo(torch.float32).min)  # transformers' masks
    with tl.use_backend("cpu", path=path):
        torch.testing.assert_close(layer.attention(q, additive, 0.125), out)
        torch.testing.assert_close(layer.attention(q, finfo_min, 0.125), out)
        strided = finfo_min.transpose(-1, -2).contiguous().transpose(-1, -2)  # keys not adjacent in memory
        torch.testing.assert_close(layer.attention(q, strided, 0.125), out)


@pytest.mark.parametrize("path", ["scalar", "avx2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_kv_attention_prefill_rows_that_see_no_key(path, threads):
    """A prefill block whose first query row sees no key: NaN there (as softmax of all -inf), exact
    elsewhere; with transformers' finfo.min mask that row attends uniformly, as softmax does. One
    task holds 6-12 rows x 4 heads (the AVX2 query-lane path)."""
    from torch_lowbit.ops import cpu_extension
    if path not in cpu_extension().available_cpu_paths():
        pytest.skip(f"CPU path {path} not available")
    gen = _gen()
    b, hkv, g, rows, length, d = 1, 1, 4, 48, 61, 32
    layer = tl.QuantizedKVLayer(length, bits=4, group=32, residual_length=0, rotate_keys=True)
    keys, values = layer.update(torch.randn(b, hkv, length, d, generator=gen), torch.randn(b, hkv, length, d, generator=gen))
    q = torch.randn(b, hkv * g, rows, d, generator=gen)
    mask = (torch.arange(length)[None, :] <= (length - rows + torch.arange(rows))[:, None]).expand(b, 1, rows, length).clone()
    mask[0, 0, 0] = False  # the first row sees nothing
    ref = _reference_attention(q, keys, values, mask, 0.2)
    finfo_min = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    ref_finfo = _reference_attention(q, keys, values, finfo_min, 0.2)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with tl.use_backend("cpu", path=path):
            out = layer.attention(q, mask, 0.2)
            out_finfo = layer.attention(q, finfo_min, 0.2)
    finally:
        torch.set_num_threads(old)
    assert torch.isnan(out[:, 0]).all() and torch.isnan(ref[:, 0]).all()
    torch.testing.assert_close(out[:, 1:].double(), ref[:, 1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out_finfo.double(), ref_finfo, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("b,h,hkv,s,length,d", [(1, 9, 3, 1, 37, 64), (2, 4, 4, 5, 11, 16), (1, 6, 2, 7, 7, 32)])
def test_gqa_attention_matches_repeated_kv_softmax(b, h, hkv, s, length, d, mask_kind):
    gen = torch.Generator().manual_seed(b * 1000 + h * 100 + s * 10 + length)
    q, k, v = (torch.randn(b, n, m, d, generator=gen) for n, m in ((h, s), (hkv, length), (hkv, length)))
    keep = torch.rand(b, 1, s, length, generator=gen) > 0.3
    keep[..., 0] = True  # every query sees at least one key
    mask = {"none": None, "bool": keep,
            "additive": torch.where(keep, 0.0, torch.finfo(torch.float32).min)}[mask_kind]
    scale = d ** -0.5
    got = torch.ops.torch_lowbit.gqa_attention(q, k, v, mask, scale)
    kr, vr = (t.repeat_interleave(h // hkv, dim=1).double() for t in (k, v))  # transformers' repeat_kv order
    scores = q.double() @ kr.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    want = (scores.softmax(-1) @ vr).transpose(1, 2)
    assert got.shape == (b, s, h, d)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    fake = torch.library.opcheck(torch.ops.torch_lowbit.gqa_attention.default, (q, k, v, mask, scale))
    assert all(v == "SUCCESS" for v in fake.values()), fake


def test_gqa_attention_rejects_bad_heads():
    q, k = torch.randn(1, 5, 1, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="not a multiple of KV heads"):
        torch.ops.torch_lowbit.gqa_attention(q, k, k, None, 1.0)
