"""Custom ops (torch.ops.torch_lowbit.*) and the backend switch.

Every schema and the C++ CPU kernels come from the extension (the op table in csrc/ops.cpp); each op
family's Python side is one module here: its typed wrappers (what the layouts call), its fake impls
(shapes and validation for torch.compile and meta tensors), its CUDA impls (Triton) and the Python
CPU impls of the ops with no C++ kernel. Importing the package registers them all."""
from . import attention, gcb, lowbit, lut4, lut_i8, palette, q4x  # noqa: F401  (registration at import)
from ._common import Backend, OpCall
from .backend import BACKENDS, current_backend, resolve_backend, use_backend
from .extension import cpu_extension, cpu_model

FAMILIES = (attention, gcb, lowbit, lut4, lut_i8, palette, q4x)  # the op family modules (tools/format_index.py)

__all__ = ["BACKENDS", "Backend", "FAMILIES", "OpCall", "cpu_extension", "cpu_model", "current_backend",
           "resolve_backend", "use_backend"]
