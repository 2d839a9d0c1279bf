"""Hugging Face transformers integration (needs the `transformers` extra).

    from transformers import AutoModelForCausalLM
    from torch_lowbit.hf import LowbitConfig
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=LowbitConfig("q4_0"))  # quantized while loading
    model.save_pretrained(out)                                  # config.json + sharded safetensors of packed buffers
    model = AutoModelForCausalLM.from_pretrained(out)           # straight into QuantLinear modules
    quantize_streaming(src, "q4_0", out, rounding="gptq", calibration=batches)  # block by block, larger than memory

The quantization method "torch_lowbit" is registered with transformers' public hooks when this
package's API is first used, or (after `import torch_lowbit`) when transformers loads its model
code, so `import torch_lowbit` stays as fast as without transformers. See docs/hf.md.
"""
import importlib

_API = {"LowbitConfig": ".config", "HF_FORMAT_VERSION": ".config", "QUANT_METHOD": ".config",
        "LowbitHfQuantizer": ".quantizer", "load_quantized_model": ".load", "save_pretrained": ".load", "is_quantized_folder": ".load",
        "quantize_streaming": ".streaming"}

__all__ = sorted(_API)


def __getattr__(name: str):
    # lazy: importing transformers' quantizer machinery costs seconds, so only when used
    if name not in _API:
        raise AttributeError(f"module 'torch_lowbit.hf' has no attribute {name!r}")
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ImportError(f"torch_lowbit.hf needs transformers>=5 (its quantizer API); found {transformers.__version__}: "
                          "pip install 'transformers>=5'")
    from .register import register
    register()
    return getattr(importlib.import_module(_API[name], __name__), name)
