"""Backend choice: "auto" (by device: CPU -> compiled C++ kernels, CUDA -> Triton), or forced with
use_backend("reference" | "cpu" | "triton") for debugging and tests."""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Optional

BACKENDS = ("auto", "reference", "cpu", "triton")

_state = threading.local()


def current_backend() -> str:
    return getattr(_state, "backend", "auto")


def resolve_backend(device_type: str) -> str:
    """The backend a QuantLinear on `device_type` runs with now."""
    b = current_backend()
    if b == "auto":
        return "cpu" if device_type == "cpu" else "triton"
    if b == "cpu" and device_type != "cpu":
        raise RuntimeError(f"use_backend('cpu') but the tensors are on {device_type}; move the model to "
                           "the CPU or use the 'triton' or 'reference' backend")
    if b == "triton" and device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("use_backend('triton') on CPU tensors needs the Triton interpreter: set "
                           "TRITON_INTERPRET=1 in the environment before importing torch_lowbit")
    return b


@contextlib.contextmanager
def use_backend(name: str, *, path: Optional[str] = None) -> Iterator[None]:
    """Force the kernel backend inside a `with` block (per thread).

    name: "reference" (pure torch dequantize + matmul), "cpu" (compiled kernels), "triton", "auto".
    path: for "cpu", force an ISA path ("scalar", "avx2", "avxvnni", "avx512") instead of the best one.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    from .extension import cpu_extension
    previous, previous_path = current_backend(), None
    if path is not None:
        if name != "cpu":
            raise ValueError("path= selects a CPU ISA path and goes with use_backend('cpu', path=...)")
        c = cpu_extension()
        if path not in c.available_cpu_paths():
            raise ValueError(f"CPU path {path!r} cannot run here; available: {c.available_cpu_paths()}")
        previous_path = c.get_cpu_path()
        c.set_cpu_path(path)
    _state.backend = name
    try:
        yield
    finally:
        _state.backend = previous
        if previous_path is not None:
            # the path in force before (an outer block's, TORCH_LOWBIT_CPU_PATH's), not "auto"
            cpu_extension().set_cpu_path(previous_path)
