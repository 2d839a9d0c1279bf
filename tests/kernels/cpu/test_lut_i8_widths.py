"""The C++ checks of lut_i8_linear spell out the Python width sets (csrc/lut_i8_linear.cpp cannot import
core/packing.py): the C++ op accepts exactly LUT_I8_CODE_BITS, and with sub_groups exactly GCB_CODE_BITS."""
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
