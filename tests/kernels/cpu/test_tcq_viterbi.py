"""TCQ's Viterbi encoder kernel (csrc/tcq_viterbi.cpp, the torch_lowbit::tcq_viterbi op): each vector
ISA path against the scalar path bit for bit, and the op's own input checks. The format (tables,
packing, the encoder against its Python reference, quality): tests/formats/test_tcq.py."""
import pytest
import torch

from torch_lowbit.formats import tcq

SEED_FILE = "test_tcq.py"  # split out of tests/test_tcq.py: its seeds (conftest.stable_seed)


def _cpu_paths():
    from torch_lowbit.ops import cpu_extension

    return cpu_extension().available_cpu_paths()


@pytest.fixture
def cpu_path():
    """Sets the CPU kernel path for the test, restoring automatic choice afterwards."""
    from torch_lowbit.ops import cpu_extension

    ext = cpu_extension()
    yield ext.set_cpu_path
    ext.set_cpu_path("auto")


@pytest.mark.parametrize("bits", [1.5, 2.0, 3.0, 4.0, 5.0])
@pytest.mark.parametrize("path", ["avx512", "avx2"])
def test_vector_viterbi_equals_scalar(bits, path, cpu_path):
    if path not in _cpu_paths():
        pytest.skip(f"CPU path {path} not available on this CPU")
    x = torch.randn(15, 256)  # one full batch of 8 and a remainder of 7 (AVX2: 4 + 4, 4 + 3)
    cpu_path("scalar")
    scalar = tcq.tcq_viterbi(x, bits)
    cpu_path(path)
    vector = tcq.tcq_viterbi(x, bits)
    assert torch.equal(scalar[0], vector[0]) and torch.equal(scalar[1], vector[1])


def test_op_checks_its_arguments():
    op = tcq._extension_viterbi  # loads the extension
    values = tcq.tcq_state_values(2.0)
    op(torch.randn(1, 256), 2.0, "hyb")
    viterbi = torch.ops.torch_lowbit.tcq_viterbi
    with pytest.raises(RuntimeError, match="shift_bits must be in 3..10"):
        viterbi(torch.randn(1, 256), values, 11)
    with pytest.raises(RuntimeError, match=r"sequences must be fp32 \[N, 256\]"):
        viterbi(torch.randn(1, 128), values, 4)
    with pytest.raises(RuntimeError, match="state_values must be fp32"):
        viterbi(torch.randn(1, 256), values[:100], 4)
    bad = torch.randn(2, 256)
    bad[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        viterbi(bad, values, 4)
