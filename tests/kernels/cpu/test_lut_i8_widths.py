"""The C++ checks of lut_i8_linear spell out the Python width sets (csrc/lut_i8_linear.cpp cannot import
core/packing.py): the C++ op accepts exactly LUT_I8_CODE_BITS, and with sub_groups exactly GCB_CODE_BITS;
its K-quant (sub_scales) and wide-code arguments are checked."""
import pytest
import torch

from torch_lowbit.core.packing import GCB_CODE_BITS, LUT_I8_CODE_BITS
from torch_lowbit.ops import cpu_extension


def _lut_i8_args(bits: int, sub_groups: bool):
    """Valid buffers of one 16-row tile, K = 64, for b-bit codes (a zero-size code plane for b = 0)."""
    entries = 2 ** min(bits, 8)
    table = (torch.arange(entries) - entries // 2).to(torch.int8)  # 8 bits: code - 128, as q8_0's
    args = dict(x=torch.randn(2, 64), qweight=torch.zeros(1, 2, 64 * bits, dtype=torch.uint8),
                scales=torch.ones(1, 2 if not sub_groups else 1, 16, dtype=torch.float16), mins=None, lut=table,
                code_bits=bits, group_size=32 if not sub_groups else 64, out_features=16, bias=None)
    if sub_groups:
        args["sub_groups"] = torch.zeros(1, 2, 16, dtype=torch.uint8)
    return args


@pytest.mark.parametrize("sub_groups,bits", [(False, b) for b in range(0, 11)] + [(True, b) for b in LUT_I8_CODE_BITS])
def test_cpp_lut_i8_widths_are_the_python_sets(sub_groups, bits):
    """Plain tables: exactly LUT_I8_CODE_BITS; group codebooks (sub_groups): exactly GCB_CODE_BITS."""
    cpu_extension()
    allowed, error = (GCB_CODE_BITS, "need 2- or 3-bit codes") if sub_groups else (LUT_I8_CODE_BITS, "code_bits must be")
    call = lambda: torch.ops.torch_lowbit.lut_i8_linear(**_lut_i8_args(bits, sub_groups))  # noqa: E731
    if bits in allowed:
        assert call().shape == (2, 16)
    else:
        with pytest.raises(RuntimeError, match=error):
            call()


def _sub_scaled_args(sub: int = 16, mins: bool = True):
    """Valid K-quant-style buffers of one 16-row tile, K = 256 (one super-block), 4-bit codes."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    args = dict(x=torch.randn(3, 256, generator=g), qweight=torch.randint(0, 256, (1, 8, 256), dtype=torch.uint8, generator=g),
                scales=torch.rand(1, 1, 16, generator=g).half(), mins=-torch.rand(1, 1, 16, generator=g).half() if mins else None,
                lut=torch.arange(16, dtype=torch.int8), code_bits=4, group_size=256, out_features=13, bias=None,
                sub_scales=torch.randint(0, 64, (1, 256 // sub, 16), dtype=torch.int8, generator=g))
    if mins:
        args["sub_mins"] = torch.randint(0, 64, (1, 256 // sub, 16), dtype=torch.uint8, generator=g)
    return args


@pytest.mark.parametrize("change, error", [
    (dict(sub_scales=torch.zeros(1, 16, 16, dtype=torch.uint8)), "sub_scales must be int8"),
    (dict(sub_scales=torch.zeros(1, 4, 16, dtype=torch.int8)), "sub_scales must be int8"),  # neither K/16 nor K/32
    (dict(sub_mins=None), "sub_mins and mins come together"),
    (dict(sub_mins=torch.zeros(1, 8, 16, dtype=torch.uint8)), "sub_mins must be uint8"),
    (dict(act_bits=8), "act_bits 0"),
    (dict(sub_groups=torch.zeros(1, 8, 16, dtype=torch.uint8)), "sub_groups"),
])
def test_sub_scales_are_checked(change, error):
    """K-quant arguments that do not fit the weight are refused with the reason, never read past."""
    cpu_extension()
    args = {**_sub_scaled_args(), **change}
    with pytest.raises(RuntimeError, match=error):
        torch.ops.torch_lowbit.lut_i8_linear(**args)
    assert torch.ops.torch_lowbit.lut_i8_linear(**_sub_scaled_args()).shape == (3, 13)


def test_wide_codes_need_consecutive_tables():
    """5- and 6-bit codes are read as they are: the table must be code + a constant."""
    cpu_extension()
    for bits in (5, 6):
        n = 2 ** bits
        args = dict(x=torch.randn(2, 64), qweight=torch.zeros(1, 2, 64 * bits, dtype=torch.uint8),
                    scales=torch.ones(1, 2, 16, dtype=torch.float16), mins=None, lut=(torch.arange(n) - n // 2).to(torch.int8),
                    code_bits=bits, group_size=32, out_features=16, bias=None)
        assert torch.ops.torch_lowbit.lut_i8_linear(**args).shape == (2, 16)
        args["lut"] = args["lut"].flip(0).contiguous()
        with pytest.raises(RuntimeError, match="consecutive values"):
            torch.ops.torch_lowbit.lut_i8_linear(**args)
