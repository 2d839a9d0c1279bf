"""The C++ extension (torch_lowbit._C: every op schema and the CPU kernels, csrc/ops.cpp) and the CPU's
name, for the layers above and for test and benchmark reports."""
from __future__ import annotations

import functools

import torch


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
def cpu_extension():
    try:
        from .. import _C
    except ImportError as e:  # pragma: no cover - only on a broken install
        raise ImportError("torch_lowbit's C++ extension is not built; reinstall with "
                          "`pip install --no-build-isolation -e .` after installing torch") from e
    running = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if _C.built_torch_version() != running:  # the C++ ABI changes between torch minor releases
        raise ImportError(f"torch_lowbit's C++ extension was built against torch {_C.built_torch_version()}, but torch "
                          f"{torch.__version__} is installed: install torch=={_C.built_torch_version()}.* or rebuild "
                          "torch_lowbit against this torch (`pip install --no-build-isolation -e .`)")
    return _C
