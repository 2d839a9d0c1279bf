"""The format index (`formats --explain`): generated from the registries and the tree, for every format."""
from pathlib import Path

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.layouts import get_layout, layouts
from torch_lowbit.tools.format_index import explain

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fmt", tl.formats())
def test_every_format_explains_itself_with_real_ops_and_files(fmt):
    text = explain(fmt)
    f = tl.get_format(fmt)
    assert text.startswith(f"{fmt}: {type(f).__name__}")
    assert "torch_lowbit/formats/" in text and "[cpu default" in text
    held = [n for n in layouts() if get_layout(n).supports(f)]
    assert held and all(f"    {n}" in text for n in held)
    for name in held:
        for op, triton_module in get_layout(name).kernel_ops(f):
            assert hasattr(torch.ops.torch_lowbit, op), op  # a real op of the op table
            assert f"op torch_lowbit::{op}:" in text
            if triton_module:
                assert (ROOT / "triton_kernels" / f"{triton_module}.py").is_file()


def test_q4_0_story_names_its_files():
    text = explain("q4_0")
    assert "lut4_i8_n16 [cpu default]" in text and "lut4_rowmajor [cuda default]" in text
    assert "op torch_lowbit::lut_i8_linear: CPU csrc/lut_i8_linear.cpp" in text
    assert "op torch_lowbit::lut4_linear: CPU csrc/lut4_linear.cpp; Triton triton_kernels/lut4.py" in text
    assert "tests/formats/test_formats.py" in text


def test_unknown_format_is_rejected():
    with pytest.raises(ValueError, match="unknown format 'q4_O'"):
        explain("q4_O")
