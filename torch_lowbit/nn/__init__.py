"""Modules: QuantLinear, fused projections, the model-level quantize_ and per-layer format allocation."""
from .allocate import MixedBits, allocate_formats, mix_summary, quantized_bpw
from .fusion import ProjectionSlot
from .linear import QuantLinear
from .quantize import default_filter, quantize_

__all__ = ["QuantLinear", "ProjectionSlot", "quantize_", "default_filter", "allocate_formats", "MixedBits",
           "mix_summary", "quantized_bpw"]
