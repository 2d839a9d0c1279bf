"""Every registered format x every backend on this machine against the reference dequantizer
(ggml's test-backend-ops idea). A new format joins by registering; nothing here names a format."""
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.ops.library import cpu_extension

from conftest import triton_available


def _backends():
    out = [("cpu", p) for p in cpu_extension().available_cpu_paths()]
    if triton_available():
        out.append(("triton", None))
    return out


def _shapes(group):
    # (M, K, N): K a multiple of the group (required) but not of 64 where the group allows it;
    # N odd so every kernel meets a ragged edge; M in {1, 3, 8, 33} covers GEMV and GEMM paths.
    k_odd = group * 3 if group % 64 else group * 2 + group  # 96 for g32, 192 for g64, 384 for g128
    return [(1, k_odd, 97), (3, group * 5, 61), (8, k_odd, 130), (33, group * 2, 45)]


def _random_linear(k, n, bias, gen):
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        # heavy-ish tails and a per-row scale spread, like real weights
        lin.weight.copy_(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1) * 0.05)
        lin.weight[:, ::7] *= 4
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen) * 0.1)
    return lin


CASES = [(fmt, backend, path, shape_idx, bias, dtype)
         for fmt in tl.formats()
         for backend, path in _backends()
         for shape_idx in range(4)
         for bias in (False, True)
         for dtype in (torch.float32, torch.bfloat16)
         if backend != "triton" or (shape_idx % 2 == 0 or bias)]  # interpreter is slow: thin it a little


@pytest.mark.parametrize("fmt,backend,path,shape_idx,bias,dtype", CASES,
                         ids=lambda v: str(v).replace("torch.", "") if v is not None else "-")
def test_kernel_matches_reference(fmt, backend, path, shape_idx, bias, dtype):
    f = tl.get_format(fmt)
    m, k, n = _shapes(f.group_size)[shape_idx]
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    lin = _random_linear(k, n, bias, gen)
    q = tl.QuantLinear.from_linear(lin, fmt)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)

    w = q.dequantize().double()
    ref = x.double() @ w.T + (lin.bias.double() if bias else 0)
    with tl.use_backend(backend, path=path):
        y = q(x)
    assert y.dtype == dtype and y.shape == (m, n)
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    # fp32: only summation order differs. bf16: the output itself is rounded to bf16 (2^-8).
    assert rel < (2e-6 if dtype == torch.float32 else 6e-3), f"relative error {rel}"

    with tl.use_backend("reference"):
        y_ref = q(x)
    assert ((y_ref.double() - ref).norm() / ref.norm()).item() < (2e-6 if dtype == torch.float32 else 6e-3)


@pytest.mark.parametrize("fmt", tl.formats())
@pytest.mark.parametrize("path", cpu_extension().available_cpu_paths())
def test_dequantize_op_matches_format(fmt, path):
    f = tl.get_format(fmt)
    lin = _random_linear(f.group_size * 3, 37, False, torch.Generator().manual_seed(7))
    q = tl.QuantLinear.from_linear(lin, fmt)
    b = {k: getattr(q, k) for k in q._kernel_buffer_names}
    with tl.use_backend("cpu", path=path):
        w = torch.ops.torch_lowbit.lut4_dequantize(b["qweight"], b["scales"], b.get("mins"), b["lut"], f.group_size)
    torch.testing.assert_close(w, q.dequantize(), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("fmt", tl.formats())
def test_triton_dequantize_matches_format(fmt):
    from torch_lowbit.triton_kernels.lut4 import lut4_dequantize
    f = tl.get_format(fmt)
    lin = _random_linear(f.group_size * 3, 37, False, torch.Generator().manual_seed(11))
    q = tl.QuantLinear.from_linear(lin, fmt)
    w = lut4_dequantize(q.qweight, q.scales, getattr(q, "mins", None), q.lut, f.group_size)
    torch.testing.assert_close(w, q.dequantize(), rtol=1e-6, atol=1e-7)


def test_cpu_paths_agree_with_scalar_path():
    """Each ISA path against the portable scalar path on the same packed weight (3-D input)."""
    lin = _random_linear(320, 77, True, torch.Generator().manual_seed(3))
    q = tl.QuantLinear.from_linear(lin, "int4_g32")
    x = torch.randn(2, 5, 320)
    with tl.use_backend("cpu", path="scalar"):
        base = q(x)
    for path in cpu_extension().available_cpu_paths():
        with tl.use_backend("cpu", path=path):
            torch.testing.assert_close(q(x), base, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", tl.formats())
@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_cuda_matches_reference_at_real_sizes(fmt, m):
    lin = _random_linear(4096, 4096, True, torch.Generator().manual_seed(m)).cuda()
    q = tl.QuantLinear.from_linear(lin, fmt)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
    ref = x.float() @ q.dequantize().T + lin.bias.float()
    y = q(x)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 5e-3
