"""A format's whole story from its name: `python -m torch_lowbit formats --explain q4_0`.

Generated from the registries (the format's class, every layout that holds it with the ops its
forward runs) and, in a source checkout, from the tree itself (the C++ file that binds each op's CPU
kernel, the Triton module, the tests that name the format or its layouts), so it cannot go stale.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Optional

from ..formats import get_format
from ..layouts import default_layout, get_layout, layouts

_PACKAGE = Path(__file__).resolve().parent.parent
_REPO = _PACKAGE.parent  # a source checkout (editable install) has csrc/ and tests/ here


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(_REPO))
    except ValueError:
        return str(path)


def _cpu_kernel_file(op: str) -> Optional[str]:
    """The csrc/ file whose TORCH_LIBRARY_IMPL binds op's C++ CPU kernel (None: no C++ kernel)."""
    csrc = _REPO / "csrc"
    for path in sorted(csrc.glob("*.cpp")) if csrc.is_dir() else ():
        match = re.search(rf'm\.impl\("{re.escape(op)}",\s*&torch_lowbit::(\w+)\)', path.read_text())
        if match:
            for impl in sorted(csrc.glob("*.cpp")):  # the file that defines the bound function
                if re.search(rf"^\S.*\b{match.group(1)}\(", impl.read_text(), re.M) and impl != path:
                    return _relative(impl)
            return _relative(path)
    return None


def _python_side(op: str) -> str:
    """The module of op's typed wrapper, fakes and Python impls (ops/<family>.py; the Hadamard op's:
    rotations/ops.py)."""
    from ..ops import FAMILIES
    from ..rotations import ops as rotation_ops
    for module in (*FAMILIES, rotation_ops):
        if getattr(getattr(module, op, None), "__module__", None) == module.__name__:
            return _relative(Path(inspect.getsourcefile(module)))
    raise LookupError(f"torch_lowbit::{op} has no typed wrapper in torch_lowbit/ops/")


def _tests_naming(words: list[str]) -> list[str]:
    tests = _REPO / "tests"
    if not tests.is_dir():
        return []
    found = []
    for path in sorted(tests.rglob("test_*.py")):  # tests/<area>/test_*.py
        text = path.read_text()
        if any(re.search(rf"[\"']{re.escape(w)}[\"']", text) for w in words):
            found.append(_relative(path))
    return found


def explain(name: str) -> str:
    """Where a format's math, layouts, ops, kernels and tests are (ValueError for an unknown name)."""
    fmt = get_format(name)
    cls = type(fmt)
    lines = [f"{fmt.name}: {cls.__name__}, {fmt.bits_per_weight():.4g} bits/weight, group {fmt.group_size}",
             f"  math (quantize, reference dequantize): {_relative(Path(inspect.getsourcefile(cls)))} "
             f"class {cls.__name__}"]
    shapes = ((4096, 4096), (576, 576))
    if any(fmt.storage_bits(n, k) != fmt.bits_per_weight() * n * k for n, k in shapes):
        lines.insert(1, "  stored with its per-layer tables: " + ", ".join(
            f"{fmt.storage_bits(n, k) / (n * k):.4g} bits/weight at {n}x{k}" for n, k in shapes))
    defaults = {device: default_layout(fmt, device).name for device in ("cpu", "cuda")}
    held = [get_layout(n) for n in layouts() if get_layout(n).supports(fmt)]
    lines.append("  layouts:")
    for lay in held:
        marks = [f"{device} default" for device, n in defaults.items() if n == lay.name]
        lines.append(f"    {lay.name}{' [' + ', '.join(marks) + ']' if marks else ''}: "
                     f"{_relative(Path(inspect.getsourcefile(type(lay))))}, backends {', '.join(lay.backends)}"
                     f"{', CPU kernels per ISA path' if lay.isa_paths and 'cpu' in lay.backends else ''}")
        ops = lay.kernel_ops(fmt)
        if not ops:
            lines.append("      ops: none (plain torch)")
        for op, triton_module in ops:
            cpu = _cpu_kernel_file(op)
            where = [f"CPU {cpu}" if cpu else "CPU: Python impl"]
            if triton_module:
                where.append(f"Triton triton_kernels/{triton_module}.py")
            where.append(f"Python side {_python_side(op)}")
            lines.append(f"      op torch_lowbit::{op}: {'; '.join(where)}")
    tests = _tests_naming([fmt.name, *(lay.name for lay in held)])
    lines.append("  tests: tests/test_reference_harness.py (every format x layout x backend against the reference)"
                 + "".join(f"\n         {t}" for t in tests if not t.endswith("test_reference_harness.py")))
    return "\n".join(lines)
