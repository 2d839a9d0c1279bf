"""Versioned safetensors checkpoints of quantized models; GGUF (llama.cpp) import and export."""
from .checkpoint import CHECKPOINT_VERSION, CheckpointError, install_shells, load_quantized, module_entries, save_quantized
from .gguf import GGUFError, from_gguf
from .gguf_export import to_gguf

__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "install_shells", "load_quantized", "module_entries", "save_quantized",
           "GGUFError", "from_gguf", "to_gguf"]
