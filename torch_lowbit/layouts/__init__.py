"""Packing of format outputs per backend, and the kernel calls that read each packing."""
from . import lut4  # noqa: F401  (registers lut4_rowmajor)
from .base import Layout, default_layout, get_layout, register_layout

__all__ = ["Layout", "default_layout", "get_layout", "register_layout"]
