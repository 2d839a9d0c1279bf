"""The stream_rowmajor (int1/2/3, q8_0) and gcb_rowmajor Triton kernels (triton_kernels/lowbit.py)."""
import pytest
import torch

import torch_lowbit as tl

from conftest import tiny_llama, triton_available
from triton_helpers import (
    DOT_CONFIGS, DTYPES, GEMV_CONFIGS, check_palette, compiled_on_meta, fresh_gen, lowbit_args, lowbit_kernels,
    lowbit_module, needs_interpreter_on_cpu, on_cuda)

SEED_FILE = "test_triton_kernels.py"  # split out of tests/test_triton_kernels.py: its seeds (conftest.stable_seed)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


# int3 (codes straddle words), int2 with and without mins, int1, gcb2 / gcb3 with their superblocks
_LOWBIT_CASES = [("int3_g64", 320), ("int2_sym_g32", 320), ("int2_g128", 384), ("int1_g32", 320),
                 ("gcb2_sb64", 320), ("gcb3", 512)]


@pytest.mark.parametrize("fmt,k", _LOWBIT_CASES)
@pytest.mark.parametrize("m,config", [(1, GEMV_CONFIGS[0]), (2, GEMV_CONFIGS[0]), (4, GEMV_CONFIGS[1]), (5, DOT_CONFIGS[0]),
                                      (33, DOT_CONFIGS[1])])
def test_lowbit_forced_configs_match_reference(fmt, k, m, config):
    """Every kernel kind with split-K (empty slices included); int*: affine values (fp16) and table
    gathers (fp32 activations)."""
    gen = fresh_gen()
    q = lowbit_module(fmt, k, 45, gen)
    kind, args = lowbit_args(q)
    fn = getattr(lowbit_kernels(), f"{kind}_linear")
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1, m, k, generator=gen).to(dtype)  # 3-D input: leading dims flatten
        check_palette(x, q.dequantize(), q.bias, fn(x, *args, q.bias, config=config))


@pytest.mark.parametrize("fmt,k", _LOWBIT_CASES)
def test_lowbit_dequantize_kernels_are_exact(fmt, k):
    q = lowbit_module(fmt, k, 37, fresh_gen())
    kind, args = lowbit_args(q)
    got = getattr(lowbit_kernels(), f"{kind}_dequantize")(*args)
    assert torch.equal(got, q.dequantize())
    assert torch.equal(getattr(torch.ops.torch_lowbit, f"{kind}_dequantize")(*args), got)  # CPU impl


def test_lowbit_layouts_are_the_cuda_defaults_and_ops_run_on_cpu():
    from torch_lowbit.layouts import default_layout
    for fmt in ("int1_g64", "int2_g64", "int2_sym_g32", "int3_g128"):
        assert default_layout(tl.get_format(fmt), "cuda").name == "stream_rowmajor"
        assert default_layout(tl.get_format(fmt), "cpu").name.endswith("_i8_n16")
    assert default_layout(tl.get_format("gcb3"), "cuda").name == "gcb_rowmajor"
    gen = fresh_gen()
    for fmt in ("int3_g32", "gcb2_sb64"):  # the ops' CPU impls (reference decode + matmul)
        q = lowbit_module(fmt, 128, 21, gen)
        kind, args = lowbit_args(q)
        x = torch.randn(2, 128, generator=gen)
        check_palette(x, q.dequantize(), q.bias, getattr(torch.ops.torch_lowbit, f"{kind}_linear")(x, *args, q.bias))


def test_lowbit_model_compiles_fullgraph_through_the_ops():
    for fmt, op in (("int2_g64", "lowbit_linear"), ("gcb2_sb64", "gcb_linear")):
        model = tiny_llama()
        layout = "gcb_rowmajor" if fmt.startswith("gcb") else "stream_rowmajor"
        tl.quantize_(model, fmt, layout=layout, progress=False)
        model.to("meta")
        out, code = compiled_on_meta(model)
        assert out.shape == (2, 5, 256)
        assert code.count(f"torch_lowbit.{op}") == 2 * 4  # fused q/k/v, gate/up: one op per module


def test_lowbit_launchers_reject_bad_input(monkeypatch):
    lb = lowbit_kernels()
    q = lowbit_module("int3_g32", 64, 8, fresh_gen())
    _, (codes, bits, scales, mins, lut, group) = lowbit_args(q)
    x = torch.randn(1, 64)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16, got torch.float64"):
        lb.lowbit_linear(x.double(), codes, bits, scales, mins, lut, group)
    with pytest.raises(ValueError, match=r"codes must be int32 \[8, 6\]"):
        lb.lowbit_linear(x, codes[:, :5], bits, scales, mins, lut, group)
    with pytest.raises(ValueError, match="lut must be 8 fp32 values"):
        lb.lowbit_linear(x, codes, bits, scales, mins, lut[:4], group)
    with pytest.raises(ValueError, match="mins must be fp16"):
        lb.lowbit_linear(x, codes, bits, scales, mins.float(), lut, group)
    with pytest.raises(ValueError, match="group size 48 must be a positive multiple of 32"):
        lb.lowbit_linear(x, codes, bits, scales, mins, lut, 48)
    with pytest.raises(ValueError, match="x has 48 features, the weight has K=64"):
        lb.lowbit_linear(torch.randn(1, 48), codes, bits, scales, mins, lut, group)
    g = lowbit_module("gcb3_sb64", 128, 8, fresh_gen())
    _, (gcodes, gbits, sub, sup, cbs) = lowbit_args(g)
    with pytest.raises(ValueError, match=r"codebooks must be int8 \[1..16, 2\^code_bits\]"):
        lb.gcb_linear(torch.randn(1, 128), gcodes, 2, sub, sup, cbs)
    with pytest.raises(ValueError, match="superblock a multiple of 32 dividing K=128"):
        lb.gcb_linear(torch.randn(1, 128), gcodes, gbits, sub, sup[:, :1].repeat(1, 3), cbs)
    with pytest.raises(ValueError, match="codes is on cpu but x is on meta"):
        lb.gcb_linear(torch.randn(1, 128, device="meta"), gcodes, gbits, sub, sup, cbs)
    with pytest.raises(RuntimeError, match="lowbit: lut must be 8 fp32 values"):  # the op's own check
        torch.ops.torch_lowbit.lowbit_linear(x, codes, bits, scales, mins, lut[:4], group, None)
    needs_interpreter_on_cpu(monkeypatch, lambda: lb.gcb_linear(torch.randn(1, 128), gcodes, gbits, sub, sup, cbs))


@on_cuda
@pytest.mark.parametrize("fmt", ["int1_g64", "int2_g64", "int2_sym_g64", "int3_g128", "gcb2", "gcb3"])
@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_cuda_lowbit_kernels_match_reference_at_real_sizes(fmt, m):
    """The CUDA default layouts of int1/2/3 and gcb through the ops (autotuned) and every config kind."""
    gen = torch.Generator().manual_seed(m)
    q = lowbit_module(fmt, 4096, 4096, gen)
    w = q.dequantize().double().cuda()
    q = q.cuda()
    kind, args = lowbit_args(q)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
    for dtype in DTYPES:
        x = torch.randn(m, 4096, device="cuda").to(dtype)
        ref = x.double() @ w.T + q.bias.double()
        y = q(x)
        assert y.dtype == dtype and ((y.double() - ref).norm() / ref.norm()).item() < tol[dtype]
        for cfg in (GEMV_CONFIGS if m <= 4 else DOT_CONFIGS):
            y = getattr(lowbit_kernels(), f"{kind}_linear")(x, *args, q.bias, config=cfg)
            assert ((y.double() - ref).norm() / ref.norm()).item() < tol[dtype]
    assert torch.equal(getattr(lowbit_kernels(), f"{kind}_dequantize")(*args).double(), w)
