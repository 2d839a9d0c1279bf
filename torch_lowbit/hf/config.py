"""LowbitConfig: the `quantization_config` of torch_lowbit models in transformers.

Passed to `from_pretrained(..., quantization_config=LowbitConfig("q4_0"))` it says how to quantize
while loading; written into a saved folder's config.json it also lists, per quantized module, its
format, layout and shapes (`modules`), so loading the folder rebuilds the QuantLinear modules.
Everything in it is JSON: formats as `Format.to_json()` (kind + version + parameters).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Union

from transformers.utils.quantization_config import QuantizationConfigMixin

from ..formats import Format, format_from_json, get_format
from ..io import CheckpointError
from ..layouts import get_layout
from ..nn import MixedBits
from ..nn.select import ROUNDINGS

QUANT_METHOD = "torch_lowbit"
# Version of what a saved folder holds (this config's `modules` entries + the buffer names in the
# safetensors shards). Loading refuses other versions rather than guessing.
HF_FORMAT_VERSION = 1

FormatArg = Union[str, Format, Mapping[str, Union[str, Format]], MixedBits]


def _pkg_version() -> str:
    from ..version import __version__
    return __version__


def format_to_json(fmt: FormatArg) -> Any:
    """JSON of a format argument: one format (a name or a config) -> its Format.to_json();
    a per-layer plan -> {"plan": {fqn: json}}; MixedBits -> {"mixed_bits": {...}}."""
    if isinstance(fmt, MixedBits):
        return {"mixed_bits": {"candidates": [get_format(c).to_json() for c in fmt.candidates],
                               "target_bpw": fmt.target_bpw, "sensitivity": fmt.sensitivity}}
    if isinstance(fmt, Mapping):
        return {"plan": {str(fqn): get_format(f).to_json() for fqn, f in fmt.items()}}
    return get_format(fmt).to_json()


def format_from_config(d: Any) -> FormatArg:
    """The inverse of format_to_json (also accepts format names and configs)."""
    if isinstance(d, (str, Format)):
        return get_format(d)
    if not isinstance(d, Mapping):
        raise ValueError(f"LowbitConfig: 'format' must be a format name, a format's JSON, {{'plan': ...}} or "
                         f"{{'mixed_bits': ...}}, got {type(d).__name__}")
    if "kind" in d:
        return format_from_json(dict(d))
    if "mixed_bits" in d:
        m = d["mixed_bits"]
        return MixedBits([format_from_config(c) for c in m["candidates"]], m["target_bpw"], m.get("sensitivity"))
    plan = d["plan"] if "plan" in d else d  # saved {"plan": {...}}, or a user's {fqn: format}
    return {str(fqn): format_from_config(f) for fqn, f in plan.items()}


class LowbitConfig(QuantizationConfigMixin):
    """How transformers quantizes a model with torch_lowbit while loading it, and (after loading or
    saving) what each quantized module holds.

    format: a registered name ("q4_0"), a Format config, or a per-layer plan {fqn: format} (e.g.
    from torch_lowbit.allocate_formats). rounding: "rtn" only (data-free; calibrated roundings need
    calibration data, which from_pretrained cannot pass: use torch_lowbit.quantize_ on the float
    model, then torch_lowbit.hf.save_pretrained). fuse: q/k/v and gate/up become one QuantLinear
    each. layout: a layout name for every module (default: the weight device's best).
    modules_to_not_convert: module names (or prefixes) kept in float. include_lm_head: quantize the
    LM head too. modules / format_version / torch_lowbit_version (and, for QuaRot models,
    online_hadamard / act_quant) are written by saving.
    """

    def __init__(self, format: FormatArg = "q4_0", rounding: str = "rtn", fuse: bool = True,
                 layout: Optional[str] = None, modules_to_not_convert: Optional[list[str]] = None,
                 include_lm_head: bool = False, *, modules: Optional[dict[str, dict]] = None,
                 format_version: int = HF_FORMAT_VERSION, torch_lowbit_version: Optional[str] = None,
                 online_hadamard: Optional[list[str]] = None, act_quant: Optional[dict[str, dict]] = None,
                 **kwargs):
        self.quant_method = QUANT_METHOD
        if format_version != HF_FORMAT_VERSION:
            raise CheckpointError(
                f"this model folder was saved by torch_lowbit {torch_lowbit_version} in its Hugging Face format "
                f"version {format_version}; this torch_lowbit {_pkg_version()} reads version {HF_FORMAT_VERSION}. "
                f"Install the torch_lowbit that wrote it, or quantize the float model again and save_pretrained")
        if isinstance(format, MixedBits):
            raise ValueError(
                "LowbitConfig: MixedBits allocation compares every layer's errors before choosing, which "
                "quantizing layer by layer while loading cannot do. Choose the plan on the float model "
                "(plan = torch_lowbit.allocate_formats(model, candidates, bpw)) and pass "
                "LowbitConfig(format=plan), or quantize_(model, MixedBits(...)) and torch_lowbit.hf.save_pretrained")
        self.format = format_from_config(format)
        if rounding not in ROUNDINGS and not (rounding is None and modules is not None):
            raise ValueError(f"LowbitConfig: unknown rounding {rounding!r}; choose one of {', '.join(ROUNDINGS)}")
        if rounding != "rtn" and modules is None:  # a saved folder's config records how it was rounded
            raise ValueError(
                f"LowbitConfig(rounding={rounding!r}) needs calibration batches, which from_pretrained cannot "
                "pass. Load the float model, run torch_lowbit.quantize_(model, fmt, calibration=batches, "
                f"rounding={rounding!r}), then torch_lowbit.hf.save_pretrained(model, folder) (or, block by block "
                "for a model larger than memory, torch_lowbit.hf.quantize_streaming(src, fmt, folder, "
                "rounding=..., calibration=...)); the folder loads with AutoModelForCausalLM.from_pretrained")
        self.rounding = rounding
        if not isinstance(fuse, bool) or not isinstance(include_lm_head, bool):
            raise TypeError("LowbitConfig: fuse and include_lm_head are booleans")
        self.fuse, self.include_lm_head = fuse, include_lm_head
        if layout is not None:
            get_layout(layout)  # an unknown name fails here, before any weight is read
        self.layout = layout
        if modules_to_not_convert is not None and (isinstance(modules_to_not_convert, str) or not all(
                isinstance(m, str) for m in modules_to_not_convert)):
            raise TypeError("LowbitConfig: modules_to_not_convert is a list of module names, e.g. ['lm_head']")
        self.modules_to_not_convert = list(modules_to_not_convert) if modules_to_not_convert else None
        self.modules = modules
        # written by saving a QuaRot model: rotate_'s online-Hadamard layers and the per-token activation
        # settings of its ActQuantLinear wrappers (the KV-cache setting travels in the model config)
        self.online_hadamard = list(online_hadamard) if online_hadamard else None
        self.act_quant = dict(act_quant) if act_quant else None
        self.format_version = HF_FORMAT_VERSION
        self.torch_lowbit_version = torch_lowbit_version or _pkg_version()
        if kwargs:
            raise TypeError(f"LowbitConfig: unknown argument(s) {sorted(kwargs)}")

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "format": format_to_json(self.format), "rounding": self.rounding,
                "fuse": self.fuse, "layout": self.layout, "modules_to_not_convert": self.modules_to_not_convert,
                "include_lm_head": self.include_lm_head, "format_version": self.format_version,
                "torch_lowbit_version": self.torch_lowbit_version, "modules": self.modules,
                "online_hadamard": self.online_hadamard, "act_quant": self.act_quant}

    @classmethod
    def from_dict(cls, config_dict: dict, return_unused_kwargs: bool = False, **kwargs):
        d = dict(config_dict)
        method = d.pop("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise ValueError(f"LowbitConfig.from_dict: quant_method is {method!r}, not {QUANT_METHOD!r}")
        config = cls(**d)
        unused = {k: v for k, v in kwargs.items() if not hasattr(config, k)}
        for k, v in kwargs.items():
            if hasattr(config, k):
                setattr(config, k, v)
        return (config, unused) if return_unused_kwargs else config

    def __eq__(self, other) -> bool:
        return isinstance(other, LowbitConfig) and self.to_dict() == other.to_dict()
