"""Versioned safetensors checkpoints of quantized models."""
from .checkpoint import CHECKPOINT_VERSION, CheckpointError, install_shells, load_quantized, module_entries, save_quantized

__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "install_shells", "load_quantized", "module_entries", "save_quantized"]
