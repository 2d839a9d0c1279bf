"""q8_0's CPU kernel (lut8_i8_n16: int8 codes times per-32 int8 activation blocks) on every ISA path:
against the exact product, and bit for bit across paths with the extreme codes. The format itself:
tests/formats/test_q8.py."""
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.ops import cpu_extension

from conftest import assert_matches_product, random_linear

SEED_FILE = "test_q8.py"  # split out of tests/test_q8.py: its seeds (conftest.stable_seed)

Q8 = tl.get_format("q8_0")


@pytest.mark.parametrize("path", cpu_extension().available_cpu_paths())
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_product_on_each_path(path, m, bias, dtype):
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    k, n = 32 * 7, 16 * 5 + 3  # K not a multiple of 64, N a ragged last tile
    lin = random_linear(k, n, bias, gen)
    q = tl.QuantLinear.from_linear(lin, "q8_0")
    assert q.layout.name == "lut8_i8_n16"
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    with tl.use_backend("cpu", path=path):
        y = q(x)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_matches_product(y, q.reference_activations(x), q.dequantize(), lin.bias if bias else None, msg=path)


def test_paths_bit_exact_with_extreme_codes():
    """Codes 0 (q = -128, never written by ggml but importable) and 255 on every path, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    n, k = 35, 96
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    codes[:, :32] = torch.tensor([0, 255] * 16, dtype=torch.uint8)
    q = {"codes": codes, "scales": (torch.rand(n, k // 32, generator=gen) * 0.01).half()}
    lin = tl.QuantLinear.from_quantized("q8_0", q, n, k)
    for m in (1, 2, 5, 9):
        x = torch.randn(m, k, generator=gen) * 4
        with tl.use_backend("cpu", path="scalar"):
            base = lin(x)
        assert_matches_product(base, lin.reference_activations(x), Q8.dequantize(q), msg="scalar")
        for path in cpu_extension().available_cpu_paths():
            with tl.use_backend("cpu", path=path):
                assert torch.equal(lin(x), base), (path, m)
