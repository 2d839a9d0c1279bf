"""The kquant_stream Triton kernels (triton_kernels/kquant.py): the K-quants q2_k .. q6_k off the CPU."""
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.core.kquant_blocks import STRUCTURES

from conftest import random_linear, tiny_llama, triton_available
from triton_helpers import (
    DOT_CONFIGS, GEMV_CONFIGS, check_palette, compiled_on_meta, fresh_gen, needs_interpreter_on_cpu, on_cuda)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")

KQUANTS = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


def kquant_kernels():
    from torch_lowbit.triton_kernels import kquant
    return kquant


def kquant_module(fmt, k, n, gen, device="cpu"):
    return tl.QuantLinear.from_linear(random_linear(k, n, True, gen), fmt, layout="kquant_stream").to(device)


def kquant_args(q):
    """The op's arguments after x and before bias."""
    return (q.codes, q.fmt.code_bits, q.sub_scales, getattr(q, "sub_mins", None), q.d, getattr(q, "dmin", None),
            q.fmt.sub_block, q.fmt.code_offset)


@pytest.mark.parametrize("fmt", KQUANTS)
@pytest.mark.parametrize("m,config", [(1, GEMV_CONFIGS[0]), (3, GEMV_CONFIGS[1]), (33, DOT_CONFIGS[1])])
def test_kquant_forced_configs_match_reference(fmt, m, config):
    """GEMV and tl.dot, split-K with empty slices; fp32 and fp16 activations; 3-D input, ragged N."""
    gen = fresh_gen()
    q = kquant_module(fmt, 512, 45, gen)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(1, m, 512, generator=gen).to(dtype)
        check_palette(x, q.dequantize(), q.bias, kquant_kernels().kquant_linear(x, *kquant_args(q), q.bias,
                                                                                 config=config))


@pytest.mark.parametrize("fmt", KQUANTS)
def test_kquant_dequantize_kernel_is_exact(fmt):
    """Bit for bit the format's reference dequantizer (and the op's CPU impl), in fp32 and fp16."""
    q = kquant_module(fmt, 768, 37, fresh_gen())
    args = kquant_args(q)
    got = kquant_kernels().kquant_dequantize(*args)
    assert torch.equal(got, q.dequantize())
    assert torch.equal(kquant_kernels().kquant_dequantize(*args, dtype=torch.float16), got.half())
    assert torch.equal(torch.ops.torch_lowbit.kquant_dequantize(*args), got)


def test_kquant_stream_is_the_cuda_default_and_keeps_every_field():
    from torch_lowbit.layouts import default_layout
    gen = fresh_gen()
    for fmt in KQUANTS:
        f = tl.get_format(fmt)
        assert default_layout(f, "cuda").name == "kquant_stream"
        assert default_layout(f, "cpu").name == "kquant_i8_n16"
        assert STRUCTURES[f.code_bits] == (fmt, f.sub_block, f.code_offset, f.has_mins)  # the ops' table
        lin = random_linear(512, 19, False, gen)
        tensors = f.quantize(lin.weight)
        q = tl.QuantLinear.from_quantized(fmt, tensors, 19, 512, layout="kquant_stream")
        back = q.layout.unpack(f, dict(q.named_buffers()), 19, 512)
        assert all(torch.equal(back[key], tensors[key]) for key in tensors), fmt
        rows = torch.tensor([18, 0, 7])
        picked = q.layout.gather_rows(f, dict(q.named_buffers()), rows)
        assert all(torch.equal(picked[key], tensors[key][rows]) for key in tensors), fmt
        x = torch.randn(2, 512, generator=gen)  # the op's CPU impl: reference decode + matmul
        check_palette(x, q.dequantize(), None, torch.ops.torch_lowbit.kquant_linear(x, *kquant_args(q), None))


def test_kquant_model_compiles_fullgraph_through_the_op():
    model = tiny_llama(hidden_size=256, intermediate_size=512)
    tl.quantize_(model, "q4_k", layout="kquant_stream", progress=False)
    model.to("meta")
    out, code = compiled_on_meta(model)
    assert out.shape == (2, 5, 256)
    assert code.count("torch_lowbit.kquant_linear") == 2 * 4  # fused q/k/v, gate/up: one op per module


def test_kquant_launchers_reject_bad_input(monkeypatch):
    kq = kquant_kernels()
    q = kquant_module("q4_k", 256, 8, fresh_gen())
    codes, bits, sc, mn, d, dmin, sub, off = kquant_args(q)
    x = torch.randn(1, 256)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16, got torch.float64"):
        kq.kquant_linear(x.double(), codes, bits, sc, mn, d, dmin, sub, off)
    with pytest.raises(ValueError, match=r"codes must be int32 \[8, 32\]"):
        kq.kquant_linear(x, codes[:, :31], bits, sc, mn, d, dmin, sub, off)
    with pytest.raises(ValueError, match="4-bit codes are q4_k: sub_block 32, code_offset 0, with sub_mins"):
        kq.kquant_linear(x, codes, bits, sc, mn, d, dmin, 16, off)
    with pytest.raises(ValueError, match="code_bits must be one of"):
        kq.kquant_linear(x, codes, 8, sc, mn, d, dmin, sub, off)
    with pytest.raises(ValueError, match=r"sub_scales must be int8 \[8, 8\]"):
        kq.kquant_linear(x, codes, bits, sc.view(torch.uint8), mn, d, dmin, sub, off)
    with pytest.raises(ValueError, match="dmin must be fp16 shaped like d"):
        kq.kquant_linear(x, codes, bits, sc, mn, d, dmin.float(), sub, off)
    with pytest.raises(ValueError, match="x has 128 features, the weight has K=256"):
        kq.kquant_linear(torch.randn(1, 128), codes, bits, sc, mn, d, dmin, sub, off)
    with pytest.raises(ValueError, match="codes is on cpu but x is on meta"):
        kq.kquant_linear(torch.randn(1, 256, device="meta"), codes, bits, sc, mn, d, dmin, sub, off)
    with pytest.raises(RuntimeError, match="kquant: sub_mins and dmin come together"):  # the op's own check
        torch.ops.torch_lowbit.kquant_linear(x, codes, bits, sc, mn, d, None, sub, off, None)
    needs_interpreter_on_cpu(monkeypatch, lambda: kq.kquant_dequantize(codes, bits, sc, mn, d, dmin, sub, off))


@on_cuda
@pytest.mark.parametrize("fmt", KQUANTS)
@pytest.mark.parametrize("m", [1, 4, 64, 512])
def test_cuda_kquant_kernels_match_reference_at_real_sizes(fmt, m):
    """kquant_stream through the op (autotuned) and every forced config kind, 4096 x 4096."""
    gen = torch.Generator().manual_seed(m)
    q = kquant_module(fmt, 4096, 4096, gen)
    w = q.dequantize().double().cuda()
    q = q.cuda()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(m, 4096, device="cuda").to(dtype)
        ref = x.double() @ w.T + q.bias.double()
        y = q(x)
        assert y.dtype == dtype and ((y.double() - ref).norm() / ref.norm()).item() < tol[dtype]
        for cfg in (GEMV_CONFIGS if m <= 4 else DOT_CONFIGS):
            y = kquant_kernels().kquant_linear(x, *kquant_args(q), q.bias, config=cfg)
            assert ((y.double() - ref).norm() / ref.norm()).item() < tol[dtype]
    assert torch.equal(kquant_kernels().kquant_dequantize(*kquant_args(q)).double(), w)
