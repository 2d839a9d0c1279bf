"""q8_0 (ggml Q8_0): the format against the gguf package's reference quantizer and dequantizer, its
layouts, and building modules from already-quantized tensors. Its CPU kernel (lut8_i8_n16) on every
ISA path: tests/kernels/cpu/test_q8_kernel.py."""
import numpy as np
import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.formats.q8 import round_half_away
from torch_lowbit.layouts import default_layout, get_layout, layouts

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

Q8 = tl.get_format("q8_0")


def _weights(n, k, gen):
    """Heavy tails, an all-zero block, a block of exact .5 ties of x / d and tiny magnitudes."""
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.05)
    w[:, ::5] *= 6
    w[0, :32] = 0
    w[1, :32] = torch.arange(32) - 15.5  # amax 15.5: x / d = x * 127 / 15.5, some halves land exactly
    w[2, :32] = torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5] * 6 + [63.5, -63.5])  # d = 1: ties at .5
    w[3] *= 1e-4
    return w


def _gguf_blocks(q):
    """GGUF Q8_0 bytes from our tensors: per block fp16 d then 32 int8 q."""
    n, k = q["codes"].shape
    qs = (q["codes"].to(torch.int16) - 128).to(torch.int8).numpy().reshape(n, k // 32, 32)
    d = q["scales"].numpy().reshape(n, k // 32, 1)
    return np.concatenate([d.view(np.uint8), qs.view(np.uint8)], axis=-1).reshape(n, k // 32 * 34)


@pytest.mark.parametrize("n,k", [(7, 32), (37, 192), (64, 576)])
def test_quantize_equals_gguf_reference_quantizer(n, k):
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    w = _weights(n, k, gen)
    q = Q8.quantize(w)
    assert q["codes"].dtype == torch.uint8 and q["codes"].shape == (n, k)
    assert q["scales"].dtype == torch.float16 and q["scales"].shape == (n, k // 32)
    ref = gguf_quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(_gguf_blocks(q), ref)  # codes and scales byte for byte
    assert int(q["codes"].min()) >= 1 and int(q["codes"].max()) <= 255  # q in [-127, 127]


@pytest.mark.parametrize("n,k", [(5, 64), (33, 320)])
def test_dequantize_equals_gguf_reference_dequantizer(n, k):
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    q = Q8.quantize(_weights(n, k, gen))
    ref = gguf_quants.dequantize(_gguf_blocks(q), GGMLQuantizationType.Q8_0)
    assert torch.equal(Q8.dequantize(q), torch.from_numpy(ref))
    # and for arbitrary codes (byte 0, q = -128, included) and fp16 scales of every sign and size
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.randn(n, k // 32, generator=gen) * 10.0 ** torch.randint(-6, 3, (n, k // 32), generator=gen)).half()
    q = {"codes": codes, "scales": scales}
    ref = gguf_quants.dequantize(_gguf_blocks(q), GGMLQuantizationType.Q8_0)
    assert torch.equal(Q8.dequantize(q), torch.from_numpy(ref))


def test_round_half_away_is_c_roundf():
    v = torch.tensor([0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997, 126.5, 2.4999998, 0.0, -0.0, 3.7])
    expected = torch.tensor([1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 0.0, -0.0, 127.0, 2.0, 0.0, 0.0, 4.0])
    assert torch.equal(round_half_away(v), expected)


def test_layouts_and_bits():
    assert Q8.bits_per_weight() == 8.5 and Q8.code_bits == 8 and Q8.layout_family == "lut8"
    held = sorted(n for n in layouts() if get_layout(n).supports(Q8))
    assert held == ["lut8_i8_n16", "stream_rowmajor"]
    assert default_layout(Q8, "cpu").name == "lut8_i8_n16"
    assert default_layout(Q8, "cuda").name == "stream_rowmajor"


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int4_g64"])
def test_from_quantized_packs_without_requantizing(fmt):
    f = tl.get_format(fmt)
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    w = torch.randn(45, f.group_size * 3, generator=gen)
    q = f.quantize(w)
    bias = torch.randn(45, generator=gen)
    for name in layouts():
        if get_layout(name).supports(f):
            lin = tl.QuantLinear.from_quantized(fmt, q, 45, f.group_size * 3, bias=bias, layout=name)
            assert lin.layout.name == name and torch.equal(lin.dequantize(), f.dequantize(q))
            assert torch.equal(lin.bias, bias)


def test_from_quantized_rejects_bad_tensors():
    q = Q8.quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="scales must be torch.float16"):
        tl.QuantLinear.from_quantized("q8_0", {**q, "scales": q["scales"].float()}, 8, 64)
    with pytest.raises(ValueError, match=r"codes must be torch.uint8 \[8, 96\], got torch.uint8 \[8, 64\]"):
        tl.QuantLinear.from_quantized("q8_0", q, 8, 64 + 32)
    with pytest.raises(ValueError, match="exactly"):
        tl.QuantLinear.from_quantized("q8_0", {"codes": q["codes"]}, 8, 64)
    with pytest.raises(ValueError, match="not divisible by the group size"):
        tl.QuantLinear.from_quantized("q8_0", q, 8, 65)
    with pytest.raises(ValueError, match="bias must be a float tensor"):
        tl.QuantLinear.from_quantized("q8_0", q, 8, 64, bias=torch.zeros(7))
    q4 = tl.get_format("q4_0").quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="codes must be below 16"):
        tl.QuantLinear.from_quantized("q4_0", {**q4, "codes": q4["codes"] | 16}, 8, 64)


def test_importance_never_raises_a_blocks_weighted_error():
    w = torch.randn(40, 128)
    imp = torch.rand(128) ** 4 * 100
    plain, weighted = Q8.dequantize(Q8.quantize(w)), Q8.dequantize(Q8.quantize(w, imp))
    block_err = lambda d: ((d - w) ** 2 * imp).reshape(40, 4, 32).sum(-1)  # noqa: E731
    # per block up to the fp16 rounding of d, which rtn encodes against unrounded
    assert bool((block_err(weighted) <= block_err(plain) * 1.01 + 1e-12).all())
    assert block_err(weighted).sum() < block_err(plain).sum()
    with pytest.raises(ValueError, match="importance must be 128"):
        Q8.quantize(w, torch.rand(127))
