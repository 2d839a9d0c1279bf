"""The package's layers only look down: every import (module level or inside a function) of a
torch_lowbit module points to its own layer or one below, and no modules import each other in a
circle. Read from the source with ast, so it holds for code paths no other test runs."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom first. A module belongs to the first layer with a prefix equal to its name or a package of it.
LAYERS = [
    # bits, constants and locations: torch only
    ("torch_lowbit._C", "torch_lowbit.version", "torch_lowbit.core",
     "torch_lowbit.rotations._base_matrices", "torch_lowbit.rotations.hadamard"),
    ("torch_lowbit.triton_kernels",),  # GPU kernels: launchers take plain tensors and ints
    ("torch_lowbit.ops",),  # op schemas, fake impls, the C++ extension, backend choice
    ("torch_lowbit.rotations",),  # the Hadamard op's Python side
    ("torch_lowbit.formats",),  # each format's math (quantize, the reference dequantizer)
    ("torch_lowbit.layouts",),  # packing a format per backend, calling its op
    ("torch_lowbit.calibrate",),
    ("torch_lowbit.nn", "torch_lowbit.kv_cache"),  # modules; the quantized KV cache
    ("torch_lowbit.io", "torch_lowbit.compile_cache", "torch_lowbit.sampling", "torch_lowbit.generation",
     "torch_lowbit.generate_route", "torch_lowbit.native_decode", "torch_lowbit.quarot"),  # checkpoints, GGUF; compiled steps saved; sampling, generation, its route and the native decoder; recipes
    ("torch_lowbit.hf",),  # the transformers quantizer (LowbitConfig), HF folders, load_quantized_model
    ("torch_lowbit.eval", "torch_lowbit.bench", "torch_lowbit.tools"),
    ("torch_lowbit.cli", "torch_lowbit.__main__", "torch_lowbit"),
]


def _modules() -> dict[str, Path]:
    mods = {"torch_lowbit._C": None}
    for folder, package in ((ROOT / "torch_lowbit", "torch_lowbit"), (ROOT / "triton_kernels", "torch_lowbit.triton_kernels")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([package, *parts])] = path
    return mods


MODULES = _modules()


def layer_of(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "torch_lowbit"):
            return i
    assert module == "torch_lowbit", f"{module} is in no layer: add it to LAYERS"
    return len(LAYERS) - 1


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.startswith("torch_lowbit"):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("torch_lowbit"))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("torch_lowbit"):
            found.add(node.args[0].value)
    return {m for m in found if m != module}


def test_every_module_has_a_layer_and_every_import_resolves():
    for module in MODULES:
        layer_of(module)
        if MODULES[module] is not None:
            unknown = {m for m in imports_of(module) if m not in MODULES}
            assert not unknown, f"{module} imports {unknown}, which are not modules of the package"


@pytest.mark.parametrize("module", sorted(m for m, p in MODULES.items() if p is not None))
def test_imports_point_down(module):
    upward = sorted(m for m in imports_of(module) if layer_of(m) > layer_of(module))
    assert not upward, (f"{module} (layer {layer_of(module)}) imports {upward} from a layer above; "
                        "move the shared piece down (see LAYERS in tests/test_layers.py)")


def test_no_import_circles():
    # package __init__ files re-export their submodules: an edge into a package's own module is not a
    # circle through the package, so only module -> module edges between different files count
    graph = {m: {d for d in imports_of(m) if d in MODULES and not m.startswith(d + ".")}
             for m, p in MODULES.items() if p is not None}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"
