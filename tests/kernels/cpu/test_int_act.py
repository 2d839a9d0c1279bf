"""The lut_i8 kernel's integer activations (ActQuantLinear on a CPU-kernel QuantLinear): per-token
and block-scaled rounding in the kernel on each ISA path against the rounded product, the SIMD paths
bit for bit against the scalar one, the op's block and group checks. The rounding math and the
wrapper: tests/nn/test_act_quant.py; the Triton kernel: tests/kernels/triton/test_triton_int_act.py."""
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.core.activations import fake_quantize_per_token

SEED_FILE = "test_act_quant.py"  # split out of tests/test_act_quant.py: its seeds (conftest.stable_seed)


def _gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())


@pytest.mark.parametrize("path", ["scalar", "avx2", "avxvnni", "avx512"])
@pytest.mark.parametrize("fmt", ["q4_0", "int4_g64", "q8_0"])
@pytest.mark.parametrize("bits,block", [(8, 0), (4, 0), (4, 32), (3, 32), (4, 16), (2, 8)])
def test_integer_activation_kernel_matches_the_rounded_product(path, fmt, bits, block):
    """ActQuantLinear on a CPU-kernel QuantLinear: the lut_i8 kernel rounds x per token (block 32: per
    block of 32 features; 16 / 8: two-level sub-block scales) and multiplies the integers (one rounding); the result is
    x_rounded @ W_dequantized.T within fp32 error, for odd shapes (N = 37, K = 192, 1..33 tokens,
    bias). The old route (round in torch, then the kernel's own per-32 int8 blocks) rounds twice and
    misses that bound at A4."""
    from conftest import assert_matches_product, random_linear
    from torch_lowbit.ops import cpu_extension
    if path not in cpu_extension().available_cpu_paths():
        pytest.skip(f"CPU path {path} not available")
    gen = _gen()
    q = tl.QuantLinear.from_linear(random_linear(192, 37, True, gen), fmt)
    layer = tl.ActQuantLinear(q, bits, clip_ratio=0.9, block=block)
    w = q.dequantize()
    for m in (1, 5, 33):
        x = torch.randn(m, 192, generator=gen) * torch.rand(m, 1, generator=gen).add(0.1)
        x[:, 7] *= 20  # an outlier channel: the clip ratio bites
        if block:  # and blocks of very different scales
            x = x * torch.rand(m, 192 // block, 1, generator=gen).add(0.05).repeat_interleave(block, 1).reshape(m, 192)
        xq = fake_quantize_per_token(x, bits, clip_ratio=0.9, block=block)
        with tl.use_backend("cpu", path=path):
            y = layer(x)
        assert_matches_product(y, xq, w, q.bias, roundings=8, msg=f"{fmt} A{bits} block {block} M={m} {path}")
    if bits == 4:
        with tl.use_backend("cpu", path=path):
            twice = q(xq)
        with pytest.raises(AssertionError):
            assert_matches_product(twice, xq, w, q.bias, roundings=8)


@pytest.mark.parametrize("fmt", ["q4_0", "int4_pc", "int4_g64", "int4_g128", "iq4_nl", "int2_g64", "int3_g64", "q8_0"])
@pytest.mark.parametrize("bits,block", [(8, 0), (4, 0), (4, 16), (2, 8)])
def test_integer_activation_paths_agree_bit_for_bit(fmt, bits, block):
    """Per-token activations: every SIMD path sums a group's integer products in int32 and converts once
    per group, as the scalar path does, so their outputs are identical bytes (odd N, ragged token
    counts below and above the register blocks, bias; tables of every dot kind: identity, unsigned,
    signed). Sub-block activations: the vectorized quantizer gives the scalar one's bytes, and the
    per-32 epilogues are the scalar path's, so again identical bytes."""
    from conftest import random_linear
    from torch_lowbit.ops import cpu_extension
    paths = [p for p in cpu_extension().available_cpu_paths() if p != "scalar"]
    if not paths:
        pytest.skip("this CPU runs only the scalar path")
    gen = _gen()
    layer = tl.ActQuantLinear(tl.QuantLinear.from_linear(random_linear(256, 53, True, gen), fmt), bits, clip_ratio=0.95,
                              block=block)
    for m in (1, 3, 6, 17):
        x = torch.randn(m, 256, generator=gen) * torch.rand(m, 1, generator=gen).add(0.1)
        if block:  # sub-blocks of very different scales, some all zero
            x = x * torch.rand(m, 256 // block, 1, generator=gen).add(0.02).repeat_interleave(block, 1).reshape(m, 256)
            x[:, 8 * block:9 * block] = 0
        with tl.use_backend("cpu", path="scalar"):
            ref = layer(x)
        for path in paths:
            with tl.use_backend("cpu", path=path):
                assert torch.equal(layer(x), ref), f"{fmt} A{bits} M={m}: {path} differs from scalar"


def test_integer_activation_op_checks_the_block():
    q = tl.QuantLinear.from_linear(torch.nn.Linear(64, 16), "q4_0")
    args = (torch.randn(2, 64), q.qweight, q.scales, None, q.lut_i8, 4, 32, 16, q.bias, None)
    ops = torch.ops.torch_lowbit
    for block in (32, 16):
        torch.testing.assert_close(ops.lut_i8_linear(*args, 4, 1.0, block),
                                   q(fake_quantize_per_token(args[0], 4, block=block)), rtol=0.05, atol=0.05)
    with pytest.raises(RuntimeError, match="act_block must be 0 .* 32 .* 16 / 8"):
        ops.lut_i8_linear(*args, 4, 1.0, 64)
    with pytest.raises(RuntimeError, match="act_block must be 0 .* 32 .* 16 / 8"):
        ops.lut_i8_linear(*args, 0, 1.0, 32)  # blocks need act_bits
    with pytest.raises(RuntimeError, match="act_block 16 needs act_bits <= 4"):
        ops.lut_i8_linear(*args, 8, 1.0, 16)


def test_integer_activation_kernel_refuses_groups_its_int32_sums_cannot_hold():
    layer = tl.ActQuantLinear(tl.QuantLinear.from_linear(torch.nn.Linear(65536 + 32, 4), "int4_pc"), 8)
    with pytest.raises(RuntimeError, match="at most 65536 features"):
        layer(torch.randn(1, 65536 + 32))
