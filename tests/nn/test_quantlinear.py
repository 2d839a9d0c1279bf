"""QuantLinear: the foundation's contract on a single layer, and its input checks."""
import pytest
import torch

import torch_lowbit as tl

from conftest import assert_matches_product


@pytest.mark.parametrize("fmt", ["q4_0", "int4_g128"])
@pytest.mark.parametrize("m", [1, 4, 40])
def test_from_linear_matches_dequantized_matmul(fmt, m):
    lin = torch.nn.Linear(512, 384)
    q = tl.QuantLinear.from_linear(lin, fmt)
    x = torch.randn(m, 512)
    y = q(x)
    ref = x @ q.dequantize().T + lin.bias
    rel = ((y - ref).norm() / ref.norm()).item()
    assert rel < 2e-2  # the default CPU kernel quantizes activations to int8 per 32 features
    # and is exact up to summation order given those activations
    assert_matches_product(y, q.layout.reference_activations(x), q.dequantize(), lin.bias)
    exact = tl.QuantLinear.from_linear(lin, fmt, layout="lut4_rowmajor")  # fp32-activation kernels
    assert_matches_product(exact(x), x, q.dequantize(), lin.bias)
    # and the quantized layer is a faithful 4-bit copy of the float one
    assert ((q.dequantize() - lin.weight).norm() / lin.weight.norm()).item() < 0.12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_activation_dtypes_and_leading_dims(dtype):
    lin = torch.nn.Linear(256, 100)
    q = tl.QuantLinear.from_linear(lin, "int4_g64")
    x = torch.randn(2, 3, 256).to(dtype)
    y = q(x)
    assert y.dtype == dtype and y.shape == (2, 3, 100)
    ref = x.float() @ q.dequantize().T + lin.bias
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_format_config_object_and_no_bias():
    lin = torch.nn.Linear(128, 64, bias=False)
    q = tl.QuantLinear.from_linear(lin, tl.Int4(group=32, rounding="minmax"))
    assert q.bias is None and q.fmt.name == "int4_g32_minmax"
    x = torch.randn(3, 128)
    assert_matches_product(q(x), q.layout.reference_activations(x), q.dequantize())


def test_bad_inputs_get_clear_errors():
    lin = torch.nn.Linear(96, 40)
    with pytest.raises(ValueError, match="not divisible by the group size 128"):
        tl.QuantLinear.from_linear(lin, "int4_g128")
    with pytest.raises(ValueError, match="unknown format"):
        tl.QuantLinear.from_linear(lin, "int5")
    with pytest.raises(TypeError, match="nn.Linear"):
        tl.QuantLinear.from_linear(torch.nn.Conv1d(2, 2, 1), "q4_0")
    bad = torch.nn.Linear(96, 40)
    with torch.no_grad():
        bad.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        tl.QuantLinear.from_linear(bad, "q4_0")
    q = tl.QuantLinear.from_linear(lin, "q4_0")
    with pytest.raises(ValueError, match="in_features=96"):
        q(torch.randn(2, 64))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        q(torch.randn(2, 96).double())
    with pytest.raises(RuntimeError, match="is on meta but the weight is on cpu"):
        q(torch.randn(2, 96, device="meta"))
    with pytest.raises(ValueError, match="unknown backend"):
        with tl.use_backend("cuda-magic"):
            pass


def test_custom_op_checks_shapes_itself():
    q = tl.QuantLinear.from_linear(torch.nn.Linear(64, 8), "q4_0", layout="lut4_rowmajor")
    with pytest.raises(RuntimeError, match="x has 32 features but the weight has K=64"):
        torch.ops.torch_lowbit.lut4_linear(torch.randn(1, 32), q.qweight, q.scales, None, q.lut, 32, None)
    with pytest.raises(RuntimeError, match="scales must be fp16"):
        torch.ops.torch_lowbit.lut4_linear(torch.randn(1, 64), q.qweight, q.scales.float(), None, q.lut, 32, None)
    q8 = tl.QuantLinear.from_linear(torch.nn.Linear(64, 8), "q4_0", layout="lut4_i8_n16")
    with pytest.raises(RuntimeError, match="out_features 40 does not match 1 tiles"):
        torch.ops.torch_lowbit.lut_i8_linear(torch.randn(1, 64), q8.qweight, q8.scales, None, q8.lut_i8, 4, 32, 40, None)
