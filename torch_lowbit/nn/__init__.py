"""Modules: QuantLinear, fused projections, the model-level quantize_ and per-layer format allocation."""
from .allocate import MixedBits, allocate_formats, mix_summary, quantized_bpw
from .fusion import ProjectionSlot
from .linear import QuantLinear
from .quantize import quantize_
from .select import default_filter

__all__ = ["QuantLinear", "ProjectionSlot", "quantize_", "default_filter", "allocate_formats", "MixedBits",
           "mix_summary", "quantized_bpw"]
