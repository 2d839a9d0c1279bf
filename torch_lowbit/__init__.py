"""torch_lowbit: low-bit weight formats for PyTorch LLMs.

    import torch_lowbit as tl
    tl.formats()                                   # registered format names
    tl.quantize_(model, "q4_0")                    # swap nn.Linear -> QuantLinear (fused q/k/v, gate/up)
    tl.quantize_embeddings_(model, "q8_0")         # embedding -> QuantEmbedding, tied head shares it
    tl.quantize_(model, tl.MixedBits(["gcb2_sb192", "gcb3_sb192"], 3.2), calibration=batches)  # per-layer mix
    tl.save_quantized(model, "m.safetensors"); tl.load_quantized(skeleton, "m.safetensors")
    model, tok = tl.from_gguf("m.Q4_0.gguf"); tl.to_gguf(model, "out.gguf")   # llama.cpp files, blocks kept
    with tl.use_backend("reference"): ...          # pure torch; "cpu" compiled kernels; "triton"
    tl.set_num_threads(2)                          # the CPU kernels' threads (work-claiming pool)
    tl.generate(model, ids, max_new_tokens=64)      # the fast route (falls back to model.generate, says why)
    tl.CompiledGenerator(model).generate(ids, 64)  # static KV cache; native C++ steps or torch.compile'd ones
    tl.rotate_(model, seed=0)                      # QuaRot: fold norms, Hadamard-rotate (function unchanged)
    tl.QuantizedKVCache(model.config, 1024, bits=4)  # int4 KV cache (needs transformers)
    tl.quantize_(model, tl.QuaRot.parse("W4A4KV4"), calibration=batches)  # rotation + W4 + A4 + KV4
"""
from . import layouts as _layouts  # noqa: F401  (registers layouts)
from . import ops as _ops  # noqa: F401  (the op table, the C++ extension where built, fake/CUDA impls)
from .formats import (IQ4_NL, NUQ, VQ, Format, GeneralVQ, PaletteFormat, Int4, IntAsym, IntSym, Q4_0, Q8_0, ScalarCodebookFormat,
                      format_from_json, formats, get_format, register_format)
from .generation import CompiledGenerator, GenerationTimes
from .generate_route import generate
from .io import CheckpointError, GGUFError, from_gguf, load_quantized, save_quantized, to_gguf
from .nn import ActQuantLinear, quantize_activations_, MixedBits, MSQ, plan_msq, ProjectionSlot, QuantEmbedding, QuantLinear, allocate_formats, quantize_, quantize_embeddings_
from .ops import current_backend, get_num_threads, set_num_threads, threading_info, use_backend
from . import rotations  # noqa: F401  (Hadamard rotations; registers torch_lowbit::hadamard_transform impls)
from .rotations import rotate_, smooth_down_proj_
from .quarot import QuaRot

from .version import __version__

__all__ = ["Format", "ScalarCodebookFormat", "PaletteFormat", "Int4", "IntAsym", "IntSym", "Q4_0", "Q8_0", "IQ4_NL", "NUQ", "VQ", "GeneralVQ", "formats", "get_format", "register_format", "format_from_json",
           "QuantLinear", "QuantEmbedding", "ProjectionSlot", "quantize_", "quantize_embeddings_", "allocate_formats", "MixedBits", "MSQ", "plan_msq", "use_backend", "current_backend", "set_num_threads", "get_num_threads", "threading_info",
           "save_quantized", "load_quantized", "CheckpointError", "from_gguf", "to_gguf", "GGUFError", "CompiledGenerator", "GenerationTimes", "generate", "rotate_", "smooth_down_proj_", "quantize_activations_", "ActQuantLinear", "QuantizedKVCache", "QuantizedKVLayer", "QuaRot", "__version__"]


def __getattr__(name):  # the KV cache subclasses transformers' Cache: imported only when asked for
    if name in ("QuantizedKVCache", "QuantizedKVLayer"):
        from . import kv_cache
        return getattr(kv_cache, name)
    raise AttributeError(f"module 'torch_lowbit' has no attribute {name!r}")

import importlib.util as _importlib_util

if _importlib_util.find_spec("transformers") is not None:  # the optional Hugging Face quantizer
    from .hf.autoload import install as _install_hf

    _install_hf()  # registers quant_method "torch_lowbit" when transformers loads its model code
