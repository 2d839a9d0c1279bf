"""Data-aware rounding: calibration statistics and GPTQ."""
from .gptq import gptq_quantize
from .hessian import collect_hessians

__all__ = ["gptq_quantize", "collect_hessians"]
