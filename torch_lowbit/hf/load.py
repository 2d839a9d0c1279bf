"""Loading and saving quantized models the Hugging Face way.

load_quantized_model(path) is the one loader of "anything quantized" (CLI, lm-eval): a folder
saved with a LowbitConfig, or a save_quantized .safetensors file plus its base model's id / folder.
Neither route materializes float weights of the quantized layers.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from typing import Optional, Union

import torch
from torch import nn

from ..io import CheckpointError, load_quantized, module_entries
from ..nn import QuantLinear
from .config import QUANT_METHOD, LowbitConfig
from .quantizer import LowbitHfQuantizer

PathLike = Union[str, os.PathLike]


def _saved_quant_method(folder: str) -> Optional[str]:
    cfg = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg):
        return None
    with open(cfg, encoding="utf-8") as f:
        q = json.load(f).get("quantization_config")
    return q.get("quant_method") if isinstance(q, dict) else None


def is_quantized_folder(path: PathLike) -> bool:
    """Whether path is a model folder saved with a torch_lowbit quantization_config."""
    return os.path.isdir(path) and _saved_quant_method(os.fspath(path)) == QUANT_METHOD


def _tokenizer(source: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):  # a folder saved without its tokenizer
        return None


def load_quantized_model(path: PathLike, base_model: Optional[PathLike] = None, *,
                         device: Optional[Union[str, torch.device]] = None):
    """(model, tokenizer or None) of a torch_lowbit-quantized model, in eval mode.

    path: a folder written by save_pretrained with a LowbitConfig (torch_lowbit.hf.save_pretrained,
    or from_pretrained(..., quantization_config=LowbitConfig(...)).save_pretrained), loaded by
    AutoModelForCausalLM.from_pretrained; or a torch_lowbit.save_quantized .safetensors file, then
    base_model names the float model it was quantized from (a Hub id or folder): its config builds
    the skeleton on the meta device and the file fills it. The tokenizer comes from the folder or
    base_model. device: where to put the model (default: CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = os.fspath(path)
    if os.path.isdir(path):
        method = _saved_quant_method(path)
        if method != QUANT_METHOD:
            raise CheckpointError(
                f"{path} is not a torch_lowbit model folder (its config.json has quantization_config "
                f"{method!r}). Quantize it while loading: AutoModelForCausalLM.from_pretrained(path, "
                "quantization_config=torch_lowbit.hf.LowbitConfig('q4_0'))")
        model = AutoModelForCausalLM.from_pretrained(path, device_map=str(device) if device else None)
        return model.eval(), _tokenizer(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist; pass a model folder saved with save_pretrained or a "
                              "save_quantized .safetensors file")
    if base_model is None:
        raise ValueError(f"{path} is a single-file checkpoint: pass base_model=, the Hub id or folder of the "
                         "float model it was quantized from (its config builds the skeleton)")
    base_model = os.fspath(base_model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_model))
    load_quantized(model, path, device=device)
    return model.eval(), _tokenizer(base_model)


def _describing_config(model: nn.Module, rounding: Optional[str]) -> LowbitConfig:
    """A LowbitConfig that describes a model quantized with torch_lowbit.quantize_ (its modules; the
    QuaRot parts are added by the quantizer's _describe when saving)."""
    from ..nn.act_quant import unwrap_activation_quant, wrap_activation_quant
    act_quant = unwrap_activation_quant(model)  # name the layers as a fresh skeleton has them
    try:
        return _describe_modules(model, rounding)
    finally:
        wrap_activation_quant(model, act_quant)


def _describe_modules(model: nn.Module, rounding: Optional[str]) -> LowbitConfig:
    entries = module_entries(model)
    if not entries:
        raise ValueError("the model has no QuantLinear modules; quantize it first (torch_lowbit.quantize_) or "
                         "load it with from_pretrained(..., quantization_config=LowbitConfig(...))")
    formats = {fqn: m.fmt for fqn, m in model.named_modules() if isinstance(m, QuantLinear)}
    common, _ = Counter(formats.values()).most_common(1)[0]
    fmt = common if len(set(formats.values())) == 1 else {
        member: formats[fqn] for fqn, e in entries.items()
        for member in ([f"{fqn.rpartition('.')[0]}.{n}".lstrip(".") for n in e["fused_from"]]
                       if e["fused_from"] else [fqn])}
    fused = any(e["fused_from"] for e in entries.values())
    return LowbitConfig(format=fmt, rounding=rounding, fuse=fused, modules=entries)


def save_pretrained(model: nn.Module, folder: PathLike, *, rounding: Optional[str] = None, **kwargs) -> None:
    """model.save_pretrained(folder, **kwargs) for a transformers model quantized in memory with
    torch_lowbit.quantize_ (e.g. with calibration): attaches a LowbitConfig describing its
    QuantLinear modules first, so the folder loads with AutoModelForCausalLM.from_pretrained.
    rounding: recorded in the config as how the model was rounded (informational)."""
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"save_pretrained needs a transformers PreTrainedModel, got {type(model).__name__}; "
                        "for other modules use torch_lowbit.save_quantized")
    if not isinstance(getattr(model, "hf_quantizer", None), LowbitHfQuantizer):
        cfg = _describing_config(model, rounding)
        model.hf_quantizer = LowbitHfQuantizer(cfg, pre_quantized=True)
        model.config.quantization_config = cfg
        model.is_quantized, model.quantization_method = True, cfg.quant_method
    model.save_pretrained(folder, **kwargs)
