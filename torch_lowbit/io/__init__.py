"""Versioned safetensors checkpoints of quantized models."""
from .checkpoint import CHECKPOINT_VERSION, CheckpointError, load_quantized, save_quantized

__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "load_quantized", "save_quantized"]
