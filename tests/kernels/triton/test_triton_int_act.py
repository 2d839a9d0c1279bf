"""The Triton integer-activation kernel (W4A8 / W4A4 on tl.dot): rounding bit for bit, products, tuned
configs, activation blocks; on CUDA at real sizes with -m gpu."""
import pytest
import torch

import torch_lowbit as tl

from conftest import assert_matches_product, triton_available
from triton_helpers import fresh_gen, on_cuda, quantized_lut4

SEED_FILE = "test_triton_kernels.py"  # split out of tests/test_triton_kernels.py: its seeds (conftest.stable_seed)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


def _one_hot_rows(k):
    """nn.Linear whose row r picks feature r (the rest 0); int4_g64 stores it exactly (min 0, scale 1)."""
    lin = torch.nn.Linear(k, k, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(k))
    return lin


def test_integer_activation_kernel_splits_groups_to_fill_the_gpu():
    """split_groups: decode's 64 tiles at N = 4096 get K slices (2 x the SMs, at most 8), prefill's
    many tiles none, and no slice is ever empty (the tests above run 6 slices of one group at M = 1)."""
    from torch_lowbit.triton_kernels.int_act import split_groups
    from torch_lowbit.triton_kernels.matmul import sm_count
    assert sm_count(torch.device("cpu")) == 132 and sm_count(torch.device("meta")) == 132  # sized as an H100
    if torch.cuda.is_available():
        assert sm_count(torch.device("cuda")) == torch.cuda.get_device_properties(0).multi_processor_count
    assert split_groups(64, 448, 132) == (5, 90)  # q4_0 at 4096 x 14336, M = 1: 320 programs
    assert split_groups(8 * 64, 448, 132) == (1, 448)
    assert split_groups(1, 6, 132) == (6, 1) and split_groups(1, 1, 132) == (1, 1)
    for tiles in (1, 3, 64, 100, 263, 264, 265, 4000):
        for groups in (1, 2, 7, 32, 128, 449):
            split, per = split_groups(tiles, groups, 132)
            assert 1 <= split <= 8 and (split - 1) * per < groups <= split * per, (tiles, groups)


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g64", "int4_pc", "iq4_nl"])
@pytest.mark.parametrize("bits", [8, 4])
def test_integer_activation_kernel_matches_the_rounded_product(fmt, bits, monkeypatch):
    """QuaRot's W4A8 / W4A4 on the triton backend: ActQuantLinear rounds x per token and the integer
    tl.dot kernel (triton_kernels/int_act.py) multiplies the codes; the result is x_rounded @ W.T within
    fp32 error (odd N, 1..33 tokens, bias, mins), and the op's CPU reference agrees."""
    from torch_lowbit.core.activations import quantize_per_token
    from torch_lowbit.core.activations import fake_quantize_per_token
    from torch_lowbit.triton_kernels import int_act
    lut4_int_linear, calls = int_act.lut4_int_linear, []
    monkeypatch.setattr(int_act, "lut4_int_linear", lambda *a: calls.append(1) or lut4_int_linear(*a))
    gen = fresh_gen()
    q, _ = quantized_lut4(fmt, 192, 37, True, gen)
    layer = tl.ActQuantLinear(q, bits, clip_ratio=0.9)
    w = q.dequantize()
    for m in (1, 5, 33):
        x = torch.randn(m, 192, generator=gen) * torch.rand(m, 1, generator=gen).add(0.1)
        x[:, 3] *= 15
        with tl.use_backend("triton"):
            y = layer(x)
        assert calls, "the layer did not reach the integer-activation kernel"
        calls.clear()
        assert_matches_product(y, fake_quantize_per_token(x, bits, clip_ratio=0.9), w, q.bias, roundings=8,
                               msg=f"{fmt} A{bits} M={m}")
        for dtype in (torch.float32, torch.float16):  # rounded in-kernel exactly as quantize_per_token
            args = (x.to(dtype), q.qweight, q.scales, getattr(q, "mins", None), q.lut_i8, q.fmt.group_size, q.bias,
                    bits, 0.9)
            torch.testing.assert_close(lut4_int_linear(*args), torch.ops.torch_lowbit.lut4_int_linear(*args),
                                       rtol=1e-5, atol=1e-5)
        # the codes themselves: a one-hot weight row k reads back x's code k times its scale
        xq, xd = quantize_per_token(x, bits, 0.9)
        eye = tl.QuantLinear.from_linear(_one_hot_rows(192), "int4_g64", layout="lut4_rowmajor")
        y_eye = lut4_int_linear(x, eye.qweight, eye.scales, eye.mins, eye.lut_i8, 64, None, bits, 0.9)
        # one flipped code would be off by ~1e-2
        torch.testing.assert_close(y_eye, (xq.float() * xd) @ eye.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt, bits, block", [("q4_0", 8, 0), ("int4_g64", 8, 32), ("iq4_nl", 4, 16)])
def test_integer_activation_kernel_every_tuned_config_matches(fmt, bits, block, monkeypatch):
    """Every launch config the autotuner may pick for lut4_int_linear (int_act_configs: M tiles of 16 to
    64, N tiles of 32 to 256, 2 / 3 stages; split K where the tiles are few) gives the op's CPU
    reference result (odd N, ragged M, K of 3-6 groups); and the launcher asks autotune.pick with that
    space and runs what it returns."""
    from torch_lowbit.triton_kernels import int_act
    gen = fresh_gen()
    q, _ = quantized_lut4(fmt, 192, 37, True, gen)
    mins = getattr(q, "mins", None)
    asked = []

    def pick(kernel, key, candidates, default, run, device):
        asked.append((kernel, key, candidates, default))
        return candidates[-1]

    for m in (1, 33):
        x = torch.randn(m, 192, generator=gen) * torch.rand(m, 1, generator=gen).add(0.1)
        args = (x, q.qweight, q.scales, mins, q.lut_i8, q.fmt.group_size, q.bias, bits, 0.9, block)
        want = torch.ops.torch_lowbit.lut4_int_linear(*args)
        cands, default = int_act.int_act_configs(m)
        assert default in cands and all(c["BLOCK_M"] <= max(16, m) * 2 for c in cands)
        for cfg in cands:
            torch.testing.assert_close(int_act.lut4_int_linear(*args, config=cfg), want, rtol=1e-5, atol=1e-5,
                                       msg=lambda e, cfg=cfg: f"{fmt} M={m} {cfg}: {e}")
        monkeypatch.setattr(int_act.autotune, "pick", pick)
        torch.testing.assert_close(int_act.lut4_int_linear(*args), want, rtol=1e-5, atol=1e-5)
        monkeypatch.undo()
        assert asked[-1][0] == "lut4_int_linear" and asked[-1][2] == cands and f"_b{block}" in asked[-1][1]


def _block_varied(m, k, gen):
    """Activations whose 8-feature pieces differ in scale by up to 1000x, a zero 32-block, a zero
    16-feature half and an outlier: every branch of the two-level scale search."""
    x = torch.randn(m, k, generator=gen) * torch.pow(10.0, torch.rand(m, k // 8, 1, generator=gen) * 3 - 2) \
        .expand(m, k // 8, 8).reshape(m, k)
    x[:, 32:64] = 0
    x[:, 64:80] = 0
    x[:, 5] *= 40
    return x


@pytest.mark.parametrize("bits,block", [(4, 16), (4, 8), (3, 16), (2, 8), (4, 32), (8, 32)])
def test_integer_activation_kernel_rounds_blocks_bit_for_bit(bits, block):
    """The Triton rounding of block-scaled activations (per 32 features; 16 / 8: two-level scales)
    gives quantize_act_codes' codes and scales exactly (K = 1088: two programs per token, ragged)."""
    from torch_lowbit.core.activations import quantize_act_codes
    from torch_lowbit.triton_kernels.int_act import round_activations
    gen = fresh_gen()
    for m, k in ((1, 96), (5, 1088)):
        x = _block_varied(m, k, gen)
        for dtype in (torch.float32, torch.float16):
            xq, xd = round_activations(x.to(dtype), bits, 0.9, block)
            want_q, want_d = quantize_act_codes(x.to(dtype), bits, 0.9, block)
            assert torch.equal(xq, want_q) and torch.equal(xd, want_d), (m, k, dtype)


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g64", "iq4_nl"])
@pytest.mark.parametrize("bits,block", [(4, 16), (2, 8), (8, 32)])
def test_integer_activation_kernel_takes_activation_blocks(fmt, bits, block, monkeypatch):
    """Block-scaled activations (QuaRot(act_block=...)) on the triton backend reach the integer tl.dot
    kernel, which scales each 32-feature run's int32 product by its block's scale: x_rounded @ W.T
    within fp32 error (ragged M, odd N, bias, mins), equal to the op's CPU reference."""
    from torch_lowbit.core.activations import fake_quantize_per_token
    from torch_lowbit.triton_kernels import int_act
    lut4_int_linear, calls = int_act.lut4_int_linear, []
    monkeypatch.setattr(int_act, "lut4_int_linear", lambda *a: calls.append(a[-1]) or lut4_int_linear(*a))
    gen = fresh_gen()
    q, _ = quantized_lut4(fmt, 192, 37, True, gen)
    layer = tl.ActQuantLinear(q, bits, clip_ratio=0.9, block=block)
    w = q.dequantize()
    for m in (1, 5, 33):
        x = _block_varied(m, 192, gen)
        with tl.use_backend("triton"):
            y = layer(x)
        assert calls == [block], "the layer did not reach the integer-activation kernel with its blocks"
        calls.clear()
        assert_matches_product(y, fake_quantize_per_token(x, bits, clip_ratio=0.9, block=block), w, q.bias,
                               roundings=8, msg=f"{fmt} A{bits} block {block} M={m}")
        args = (x, q.qweight, q.scales, getattr(q, "mins", None), q.lut_i8, q.fmt.group_size, q.bias, bits, 0.9, block)
        torch.testing.assert_close(lut4_int_linear(*args), torch.ops.torch_lowbit.lut4_int_linear(*args),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="act_block must be 0"):
        lut4_int_linear(x, q.qweight, q.scales, getattr(q, "mins", None), q.lut_i8, q.fmt.group_size, None, 8, 0.9, 16)
    with pytest.raises(RuntimeError, match="act_block"):
        torch.ops.torch_lowbit.lut4_int_linear(x, q.qweight, q.scales, getattr(q, "mins", None), q.lut_i8,
                                               q.fmt.group_size, None, 4, 0.9, 64)


@on_cuda
@pytest.mark.parametrize("fmt", ["q4_0", "int4_g128", "int4_pc", "iq4_nl"])
@pytest.mark.parametrize("bits,block", [(8, 0), (4, 0), (4, 16), (4, 32), (2, 8)])
@pytest.mark.parametrize("m", [1, 16, 512])
def test_cuda_integer_activation_kernel_at_real_sizes(fmt, bits, block, m):
    """The integer tl.dot kernel on the GPU (IMMA): the rounding kernel's codes and scales equal
    torch's quantize_act_codes on the same CUDA tensor bit for bit (IEEE divisions, no FP fusion), and
    the product equals the rounded activations times the dequantized weight (split K at M = 1)."""
    from torch_lowbit.core.activations import dequantize_act_codes, quantize_act_codes
    from torch_lowbit.triton_kernels.int_act import round_activations
    gen = torch.Generator().manual_seed(m * 10 + bits)
    q, _ = quantized_lut4(fmt, 4096, 4096, True, gen, device="cuda")
    x = (_block_varied(m, 4096, gen) * 0.1).to("cuda", torch.float16)
    xq, xd = round_activations(x, bits, 0.9, block)
    want_q, want_d = quantize_act_codes(x, bits, 0.9, block)
    assert torch.equal(xq, want_q) and torch.equal(xd, want_d.reshape(xd.shape))  # per token: [M] vs [M, 1]
    mins = getattr(q, "mins", None)
    y = torch.ops.torch_lowbit.lut4_int_linear(x, q.qweight, q.scales, mins, q.lut_i8, q.fmt.group_size, q.bias,
                                               bits, 0.9, block)
    ref = dequantize_act_codes(want_q, want_d).double() @ q.dequantize().double().T + q.bias.double()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5
