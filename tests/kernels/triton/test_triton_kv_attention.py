"""The Triton kv_attention kernel (triton_kernels/kv_attention.py) against the CPU kernel."""
import pytest
import torch

import torch_lowbit as tl

SEED_FILE = "test_kv_cache.py"  # split out of tests/test_kv_cache.py: its seeds (conftest.stable_seed)


def _gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())


@pytest.mark.parametrize("bits,group,d,residual,g", [(4, 64, 64, 0, 2), (4, 16, 48, 5, 3), (8, 32, 96, 3, 1)])
def test_triton_kv_attention_matches_the_cpu_kernel(bits, group, d, residual, g, monkeypatch):
    """triton_kernels/kv_attention.py under the interpreter: online softmax over blocks of positions,
    codes rebuilt in registers, the exact ring in place; same result as the CPU kernel (fp32), in one
    pass and split over positions (flash-decoding: 2, 4 and 8 splits, the last ones empty or wholly
    masked, merged by the combine kernel); one program serves the g query heads of a KV head (g = 3: a
    padded head lane)."""
    from conftest import triton_available
    if not triton_available():
        pytest.skip("triton is not installed")
    gen = _gen()
    b, hkv, length, filled = 2, 3, 150, 141  # more positions than one block, a ragged tail
    layer = tl.QuantizedKVLayer(length, bits=bits, group=group, residual_length=residual)
    layer.update(torch.randn(b, hkv, filled, d, generator=gen), torch.randn(b, hkv, filled, d, generator=gen))
    q = torch.randn(b, hkv * g, 1, d, generator=gen)
    mask = (torch.arange(length) < filled).expand(b, 1, 1, length).clone()
    mask[0, 0, 0, :7] = False
    cpu = layer.attention(q, mask, d ** -0.5)
    from torch_lowbit.triton_kernels import kv_attention as kernels
    for splits in (1, 2, 4, 8):
        monkeypatch.setattr(kernels, "_default_splits", lambda rows, length, device, n=splits: n)
        with tl.use_backend("triton"):
            out = layer.attention(q, mask, d ** -0.5)
        torch.testing.assert_close(out, cpu, rtol=2e-5, atol=2e-5, msg=f"{splits} splits")
