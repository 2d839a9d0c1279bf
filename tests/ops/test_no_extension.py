"""The build-free mode: torch_lowbit without its C++ extension (TORCH_LOWBIT_NO_EXTENSION=1 hides a built
one, as a build with TORCH_LOWBIT_BUILD_EXT=0 lacks it). In a subprocess: the import works, every op with a
C++ kernel has a CPU impl (the pure-torch reference), one warning says so the first time one runs, small
models quantized to the main format families give what the C++ kernels give, and what needs the extension
says how to build it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.ops import has_cpu_extension

from conftest import assert_matches_product

ROOT = Path(__file__).resolve().parents[2]

# (format, layout; None: the CPU default) covering the CPU kernel ops: lut_i8_linear (q4_0, iq4_nl, int2_g64,
# nuq3's int8 tiles), lut4_linear, q4x_linear, codebook_linear and hadamard_transform (nuq3), tcq_linear and
# tcq_viterbi (tcq2_1mad)
CASES = [("q4_0", None), ("iq4_nl", None), ("int2_g64", None), ("nuq3", None), ("q4_0", "lut4_rowmajor"),
         ("iq4_nl", "q4_4x4"), ("nuq3", "palette_packed"), ("tcq2_1mad", "palette_packed")]

_CHILD = r"""
import json, sys, warnings
import torch
with warnings.catch_warnings(record=True) as at_import:
    warnings.simplefilter("always")
    import torch_lowbit as tl
from torch_lowbit.ops import has_cpu_extension
from torch_lowbit.ops.schemas import CPU_KERNEL_OPS

cases, out = json.loads(sys.argv[1]), sys.argv[2]
report = {"has_extension": has_cpu_extension(), "warnings_at_import": [str(w.message) for w in at_import],
          "ops_without_cpu_impl": [op for op in CPU_KERNEL_OPS
                                   if not torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_lowbit::{op}", "CPU")]}
results = {}
with warnings.catch_warnings(record=True) as at_run:
    warnings.simplefilter("always")
    torch.manual_seed(0)
    for fmt, layout in cases:
        model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48))
        tl.quantize_(model, fmt, layout=layout, progress=False)
        x = torch.randn(3, 256)
        y0 = model[0](x)
        h = torch.relu(y0)
        results[f"{fmt}/{layout}"] = (model, [(x, y0), (h, model[2](h))])
    q, k, v = torch.randn(1, 4, 3, 32), torch.randn(1, 2, 7, 32), torch.randn(1, 2, 7, 32)
    mask = torch.ones(1, 1, 3, 7, dtype=torch.bool).tril(4)
    results["gqa_attention"] = ((q, k, v, mask), torch.ops.torch_lowbit.gqa_attention(q, k, v, mask, 0.2))
report["warnings_at_run"] = [str(w.message) for w in at_run if "C++ CPU kernels" in str(w.message)]
errors = {}
for name, call in (("use_backend path", lambda: tl.use_backend("cpu", path="scalar").__enter__()),
                   ("cpu_extension", lambda: tl.ops.cpu_extension()),
                   ("bench paths", lambda: __import__("torch_lowbit.bench.machine", fromlist=["x"]).available_paths())):
    try:
        call()
        errors[name] = None
    except ImportError as e:
        errors[name] = str(e)
report["errors"] = errors
torch.save(results, out)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def no_extension_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("no_extension") / "results.pt"
    env = dict(os.environ, TORCH_LOWBIT_NO_EXTENSION="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(CASES), str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), torch.load(out, weights_only=False)


def test_import_works_and_every_cpu_kernel_op_has_a_reference(no_extension_run):
    report, _ = no_extension_run
    assert report["has_extension"] is False
    assert report["warnings_at_import"] == []  # the warning waits for a CPU op to run a reference
    assert report["ops_without_cpu_impl"] == []


def test_one_warning_names_the_slow_references_and_the_build(no_extension_run):
    report, _ = no_extension_run
    assert len(report["warnings_at_run"]) == 1, report["warnings_at_run"]
    message = report["warnings_at_run"][0]
    assert "pure-torch references" in message and "TORCH_LOWBIT_NO_EXTENSION=1" in message
    assert "pip install --no-build-isolation -e ." in message


def test_what_needs_the_extension_names_the_fix(no_extension_run):
    report, _ = no_extension_run
    for name, error in report["errors"].items():
        assert error is not None, f"{name} ran without the extension"
        assert "pip install --no-build-isolation -e ." in error and "TORCH_LOWBIT_NO_EXTENSION=1" in error, error


@pytest.mark.skipif(not has_cpu_extension(), reason="compares with the C++ kernels: needs the built extension")
@pytest.mark.parametrize("fmt,layout", CASES)
def test_references_give_what_the_kernels_give(no_extension_run, fmt, layout):
    """Each layer quantized and run without the extension, then run here by the C++ kernels on the same
    input: both within the fp32 bound of the exact product (the bound the kernel tests hold the kernels to)."""
    _, results = no_extension_run
    model, layers = results[f"{fmt}/{layout}"]
    for q, (x, y_reference) in zip((model[0], model[2]), layers):
        if layout is not None:
            assert q.layout.name == layout
        expected = (q.reference_activations(x), q.dequantize(), q.bias)
        assert_matches_product(y_reference, *expected, msg=f"{q.layout.name} reference:")
        assert_matches_product(q(x), *expected, msg=f"{q.layout.name} C++ kernel:")


@pytest.mark.skipif(not has_cpu_extension(), reason="compares with the C++ kernel: needs the built extension")
def test_attention_reference_gives_what_the_kernel_gives(no_extension_run):
    _, results = no_extension_run
    args, y_reference = results["gqa_attention"]
    torch.testing.assert_close(y_reference, torch.ops.torch_lowbit.gqa_attention(*args, 0.2), rtol=1e-5, atol=1e-6)
