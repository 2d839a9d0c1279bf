"""The op table (torch_lowbit/ops/schemas.py) is what the dispatcher holds, all of it, and the C++ kernels
bind to it whichever registers first: the extension loaded before the Python definitions still serves the
ops, and a definition that disagrees with a kernel's signature is refused."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_lowbit  # noqa: F401  (defines the ops)
from torch_lowbit.ops import cpu_extension, has_cpu_extension
from torch_lowbit.ops.schemas import CPU_KERNEL_OPS, NAMESPACE, SCHEMAS

ROOT = Path(__file__).resolve().parents[2]


def test_schemas_are_what_torch_reports():
    for name, schema in SCHEMAS.items():
        assert getattr(torch.ops.torch_lowbit, name).default._schema == torch._C.parse_schema(f"{NAMESPACE}::{schema}")


def test_the_table_holds_every_op_of_the_namespace():
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith(f"{NAMESPACE}::")}
    assert registered == set(SCHEMAS)
    assert set(CPU_KERNEL_OPS) <= set(SCHEMAS)


def test_every_op_with_a_cpu_kernel_has_a_cpu_impl():
    for op in CPU_KERNEL_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", "CPU"), op


def test_cpu_kernels_come_from_the_extension_where_it_is_loaded():
    for op in CPU_KERNEL_OPS:
        dump = torch._C._dispatch_dump(f"{NAMESPACE}::{op}")
        cpu = next(line for line in dump.splitlines() if line.startswith("CPU:"))
        assert (".cpp" in cpu) == has_cpu_extension(), cpu


# Loads the built extension before anything of the package (the kernels register first), then either
# imports the package (the Python definitions second) and runs an op, or defines a wrong schema.
_LOAD_FIRST = r"""
import importlib.machinery, importlib.util, sys
import torch
so = sys.argv[2]
loader = importlib.machinery.ExtensionFileLoader("torch_lowbit._C", so)
loader.exec_module(importlib.util.module_from_spec(importlib.util.spec_from_file_location("torch_lowbit._C", so, loader=loader)))
if sys.argv[1] == "import":
    import torch_lowbit as tl
    assert ".cpp" in torch._C._dispatch_dump("torch_lowbit::lut4_linear")
    q = tl.QuantLinear.from_linear(torch.nn.Linear(64, 16), "q4_0", layout="lut4_rowmajor")
    print(tuple(q(torch.randn(2, 64)).shape))
else:
    lib = torch.library.Library("torch_lowbit", "DEF")
    lib.define("lut4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, int group_size) -> Tensor")
"""


def _load_first(mode):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", _LOAD_FIRST, mode, cpu_extension().__file__], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(not has_cpu_extension(), reason="needs the built extension")
def test_kernels_registered_before_the_definitions_serve_the_ops():
    run = _load_first("import")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "(2, 16)"


@pytest.mark.skipif(not has_cpu_extension(), reason="needs the built extension")
def test_a_schema_that_disagrees_with_the_kernel_is_refused():
    run = _load_first("mismatch")
    assert run.returncode != 0
    assert "lut4_linear" in run.stderr and "inferred schema" in run.stderr, run.stderr[-3000:]
