"""The C++ extension (torch_lowbit._C: the CPU kernels of csrc/, bound to the op table of
ops/schemas.py) and the CPU's name, for the layers above and for test and benchmark reports.

The extension is optional: an install without it (TORCH_LOWBIT_BUILD_EXT=0, no C++ toolchain) runs the
Triton kernels on CUDA and pure-torch references on the CPU. TORCH_LOWBIT_NO_EXTENSION=1 (read once,
at import) hides a built extension, so tests run that mode in the same checkout.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch

from . import schemas  # noqa: F401  (the op table first: the kernels the extension loads bind to it)

HIDE_EXTENSION_ENV = "TORCH_LOWBIT_NO_EXTENSION"
EXTENSION_HIDDEN = os.environ.get(HIDE_EXTENSION_ENV, "") not in ("", "0")
BUILD_HINT = ("build it with a C++ compiler installed: `pip install --no-build-isolation -e .` in the "
              "torch_lowbit checkout, after installing torch")


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU's model name (for benchmark rows and test reports)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def _load() -> tuple[Optional[object], str]:
    """(the extension module, "") or (None, why it is absent). A present extension built against another
    torch raises: its kernels are already registered and would run against a foreign ABI."""
    if EXTENSION_HIDDEN:
        return None, f"hidden by {HIDE_EXTENSION_ENV}=1"
    try:
        from .. import _C
    except ImportError as e:  # not built (a build-free install), or a .so that cannot load
        return None, f"torch_lowbit._C cannot be imported ({e})"
    running = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if _C.built_torch_version() != running:  # the C++ ABI changes between torch minor releases
        raise ImportError(f"torch_lowbit's C++ extension was built against torch {_C.built_torch_version()}, but torch "
                          f"{torch.__version__} is installed: install torch=={_C.built_torch_version()}.* or rebuild "
                          "torch_lowbit against this torch (`pip install --no-build-isolation -e .`)")
    return _C, ""


def has_cpu_extension() -> bool:
    """Whether the C++ CPU kernels are loaded (False on a build-free install or with
    TORCH_LOWBIT_NO_EXTENSION=1: the CPU then runs the pure-torch references)."""
    return _load()[0] is not None


def cpu_extension():
    """The extension module, for what needs it (ISA paths, the bandwidth and clock probes); ImportError
    naming the fix where it is absent."""
    module, why = _load()
    if module is None:
        raise ImportError(f"this needs torch_lowbit's C++ extension, which is not loaded: {why}; {BUILD_HINT}")
    return module


@functools.lru_cache(maxsize=None)
def warn_reference_cpu_kernels() -> None:
    """Once per process, the first time a CPU op runs its pure-torch reference instead of a C++ kernel."""
    message = (f"torch_lowbit's C++ CPU kernels are not loaded ({_load()[1]}): CPU ops run slow pure-torch "
               f"references (CUDA runs the Triton kernels as usual). For the fast CPU kernels, {BUILD_HINT}.")
    warnings.warn(message, UserWarning, stacklevel=3)
