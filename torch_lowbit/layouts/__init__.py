"""Packing of format outputs per backend, and the kernel calls that read each packing."""
from . import lut4, lut4_i8  # noqa: F401  (registers lut4_rowmajor, lut4_i8_n16)
from .base import Layout, default_layout, get_layout, layouts, register_layout

__all__ = ["Layout", "default_layout", "get_layout", "layouts", "register_layout"]
