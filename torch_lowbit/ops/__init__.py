"""Custom ops (torch.ops.torch_lowbit.*) and the backend switch."""
from . import library  # noqa: F401  (registers fake and CUDA implementations)
from .backend import BACKENDS, current_backend, resolve_backend, use_backend

__all__ = ["BACKENDS", "current_backend", "resolve_backend", "use_backend"]
