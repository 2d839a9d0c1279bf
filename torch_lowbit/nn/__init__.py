"""Modules: QuantLinear, fused projections and the model-level quantize_."""
from .fusion import ProjectionSlot
from .linear import QuantLinear
from .quantize import default_filter, quantize_

__all__ = ["QuantLinear", "ProjectionSlot", "quantize_", "default_filter"]
