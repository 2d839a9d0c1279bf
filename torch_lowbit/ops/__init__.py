"""Custom ops (torch.ops.torch_lowbit.*) and the backend switch.

Every schema is defined here, in the op table of schemas.py; the C++ CPU kernels come from the optional
extension (csrc/, ops/extension.py). Each op family's Python side is one module here: its typed wrappers
(what the layouts call), its fake impls (shapes and validation for torch.compile and meta tensors), its
CUDA impls (Triton), the Python CPU impls of the ops with no C++ kernel, and the pure-torch references
that stand in for the C++ kernels where the extension is absent. Importing the package registers them all."""
from . import attention, gcb, gvq, kquant, lowbit, lut4, lut_i8, palette, q4x  # noqa: F401  (registration at import)
from ._common import Backend, OpCall
from .backend import BACKENDS, current_backend, resolve_backend, use_backend
from .extension import cpu_extension, cpu_model, has_cpu_extension
from .threads import get_num_threads, set_num_threads, threading_info

FAMILIES = (attention, gcb, gvq, kquant, lowbit, lut4, lut_i8, palette, q4x)  # the op family modules (tools/format_index.py)

__all__ = ["BACKENDS", "Backend", "FAMILIES", "OpCall", "cpu_extension", "cpu_model", "current_backend",
           "get_num_threads", "has_cpu_extension", "resolve_backend", "set_num_threads", "threading_info", "use_backend"]
