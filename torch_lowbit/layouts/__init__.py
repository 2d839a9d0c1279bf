"""Packing of format outputs per backend, and the kernel calls that read each packing."""
from . import gcb, ggml_k, gvq, kquant_i8, kquant_stream, lut4, lut_i8, palette_dense, palette_packed, q4x, stream_rowmajor  # noqa: F401  (registers
#   gcb_rowmajor, gcb_i8_n16, ggml_k_blocks, gvq_rowmajor, kquant_i8_n16, kquant_stream, stream_rowmajor, lut4_rowmajor, lut{1..6,8}_i8_n16, nuq_i8_n16,
#   palette_dense, palette_packed,
#   q4_4x4, q4_4x8, q4_8x8)
from .base import Layout, default_layout, get_layout, layouts, register_layout

__all__ = ["Layout", "default_layout", "get_layout", "layouts", "register_layout"]
