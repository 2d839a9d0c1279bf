"""Registers LowbitConfig / LowbitHfQuantizer as quant_method "torch_lowbit" with transformers."""
from transformers.quantizers.auto import register_quantization_config, register_quantizer

from .config import QUANT_METHOD, LowbitConfig
from .quantizer import LowbitHfQuantizer

_done = False


def register() -> None:
    """Idempotent: transformers refuses a second registration of one name."""
    global _done
    if _done:
        return
    for hook, cls in ((register_quantization_config, LowbitConfig), (register_quantizer, LowbitHfQuantizer)):
        try:
            hook(QUANT_METHOD)(cls)
        except ValueError:  # registered by an earlier copy of this module (a reload): keep that one
            pass
    _done = True
