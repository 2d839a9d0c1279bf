"""Data-aware rounding: calibration statistics (input Hessians, weight Fisher) and GPTQ."""
from .gptq import gptq_quantize
from .hessian import HessianCollector, collect_fisher, collect_hessians

__all__ = ["gptq_quantize", "collect_hessians", "collect_fisher", "HessianCollector"]
