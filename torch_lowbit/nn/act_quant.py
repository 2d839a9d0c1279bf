"""Per-token activation quantization of linear-layer inputs (QuaRot's A8 / A4), pure torch.

`quantize_activations_(model, bits)` wraps each selected linear layer so its input is rounded to a
per-token integer grid before the layer runs: symmetric q = clamp(round(x / d), -2^(b-1), 2^(b-1)-1)
(-127 .. 127 at 8 bits) with d = c * max|x| / (2^(b-1) - 1), or asymmetric (min/max to 0 .. 2^b - 1 with a zero point).
c <= 1 is the clipping ratio; with calibration batches it is searched per layer over a grid (the
ratio minimizing the squared error of the layer's quantized input, as QuaRot picks its clip ratio).
block > 0 gives each block of that many features of a token its own scale instead (block-scaled
activations as MXINT4 / NVFP4 use them): 32 (one fp32 scale per 32 features) or 16 / 8 (symmetric, at
most 4 bits: two-level scales, one per 32 features times an integer multiplier per sub-block,
act_codes.quantize_sub_blocks) are rounded by the int8-weight CPU kernels and the Triton integer-activation
kernel themselves; multiples of 64 (and asymmetric blocks) are rounded in torch before the layer runs.

This is the reference for activation-quantized execution: the layer sees exactly the values an
integer-activation kernel would multiply with. It composes with weight formats (wrap after
quantize_) and with rotate_ (inside OnlineHadamardLinear the wrapped layer sees the rotated input).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import Tensor, nn

from ..core.activations import check_act_bits, check_act_block, fake_quantize_per_token, search_clip_ratio


class ActQuantLinear(nn.Module):
    """layer(fake_quantize_per_token(x)): a linear-like layer whose input is bits-bit per token."""

    def __init__(self, layer: nn.Module, bits: int, symmetric: bool = True, clip_ratio: float = 1.0, block: int = 0):
        super().__init__()
        check_act_bits(bits)
        check_act_block(block, getattr(layer, "in_features", None), bits if symmetric else None)
        self.layer, self.bits, self.symmetric, self.clip_ratio = layer, bits, symmetric, float(clip_ratio)
        self.block = block
        if hasattr(layer, "split_sizes"):  # a fused qkv / gate_up module: its parent's hook splits our output
            self.split_sizes = layer.split_sizes

    def forward(self, x: Tensor) -> Tensor:
        # a QuantLinear (also one quantize_ put in after this wrapper) may round x in its kernel (per token
        # or block) and multiply integers
        int_acts = getattr(self.layer, "forward_int_acts", None)
        if self.symmetric and int_acts is not None:
            y = int_acts(x, self.bits, self.clip_ratio, self.block)
            if y is not None:
                return y
        return self.layer(fake_quantize_per_token(x, self.bits, self.symmetric, self.clip_ratio, self.block))

    def extra_repr(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        where = f"per block of {self.block}" if self.block else "per token"
        return f"A{self.bits} {where} ({kind}, clip {self.clip_ratio})"


def _is_linear(mod: nn.Module) -> bool:
    from .linear import QuantLinear
    return type(mod) is nn.Linear or isinstance(mod, QuantLinear)


@torch.no_grad()
def quantize_activations_(model: nn.Module, bits: int, *, symmetric: bool = True, clip_ratio: float = 1.0,
                          calibration: Optional[Iterable[Tensor]] = None, include_lm_head: bool = False,
                          filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
                          max_calibration_tokens: int = 2048, block: int = 0) -> nn.Module:
    """Wraps the model's linear layers (nn.Linear or QuantLinear) in ActQuantLinear, in place.

    With `calibration` (token-id batches) each layer's clipping ratio is searched over CLIP_GRID on
    its own inputs (up to max_calibration_tokens rows); otherwise every layer uses `clip_ratio`.
    The LM head keeps full-precision inputs unless include_lm_head (QuaRot keeps it so). block > 0:
    one scale per block of that many features of a token (see the module docstring)."""
    check_act_bits(bits)
    check_act_block(block, bits=bits if symmetric else None)
    if any(isinstance(m, ActQuantLinear) for m in model.modules()):
        raise ValueError("quantize_activations_: the model's activations are already quantized")
    head = getattr(model, "lm_head", None)
    targets = [(name, mod) for name, mod in model.named_modules()
               if _is_linear(mod) and (include_lm_head or mod is not head)
               and (filter_fn is None or filter_fn(mod, name))]
    if not targets:
        raise ValueError("quantize_activations_: no nn.Linear / QuantLinear layers selected")
    for name, mod in targets:
        try:
            check_act_block(block, mod.in_features, bits if symmetric else None)
        except ValueError as e:
            raise ValueError(f"quantize_activations_: layer {name}: {e}") from None
    ratios = {name: clip_ratio for name, _ in targets}
    if calibration is not None:
        inputs: dict[str, list[Tensor]] = {name: [] for name, _ in targets}

        def hook(name):
            def record(_mod, args):
                x = args[0].detach().reshape(-1, args[0].shape[-1])
                have = sum(t.shape[0] for t in inputs[name])
                if have < max_calibration_tokens:
                    inputs[name].append(x[: max_calibration_tokens - have].float().cpu())
            return record

        handles = [mod.register_forward_pre_hook(hook(name)) for name, mod in targets]
        try:
            for batch in calibration:
                model(batch)
        finally:
            for h in handles:
                h.remove()
        for name, _ in targets:
            if inputs[name]:
                ratios[name] = search_clip_ratio(torch.cat(inputs[name]), bits, symmetric, block=block)
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ActQuantLinear(mod, bits, symmetric, ratios[name], block))
    return model


def unwrap_activation_quant(model: nn.Module) -> dict[str, dict]:
    """Puts each ActQuantLinear's layer back in its place; returns {fqn: settings} for rewrap (checkpoints
    store the model unwrapped, so its tensors keep the names a fresh skeleton has)."""
    entries = {}
    for name, mod in list(model.named_modules()):
        if isinstance(mod, ActQuantLinear):
            entries[name] = {"bits": mod.bits, "symmetric": mod.symmetric, "clip_ratio": mod.clip_ratio}
            if mod.block:
                entries[name]["block"] = mod.block
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, mod.layer)
    return entries


def wrap_activation_quant(model: nn.Module, entries: dict[str, dict]) -> None:
    """The inverse of unwrap_activation_quant: wraps the named layers with their saved settings."""
    for name, e in entries.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ActQuantLinear(getattr(parent, child), int(e["bits"]), bool(e["symmetric"]),
                                              float(e["clip_ratio"]), int(e.get("block", 0))))
