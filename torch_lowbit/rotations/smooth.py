"""SmoothQuant-style smoothing of each MLP's down_proj input, before the QuaRot rotation (SmoothRot).

The down_proj input, act(gate(x)) * up(x), has a few channels with massive values in some tokens.
The Hadamard spreads them over every channel, so those tokens' per-token activation scale is set by
them and the rest of the token drowns in rounding noise. Dividing channel j by s_j = max|x_j|^alpha
(and multiplying down_proj's column j by it) shrinks the massive channels first. The division is
folded into up_proj's rows, so the function is unchanged; the online Hadamard of rotate_ then acts on
the smoothed input. On SmolLM2 alpha 0.25 gains a few percent of W16A4 perplexity and is within
noise on W4A4KV4 (docs/quarot.md "Where the W16A4 loss comes from").
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from .model import _layers

DEFAULT_SMOOTH_ALPHA = 0.25


@torch.no_grad()
def down_proj_input_max(model: nn.Module, calibration: Iterable[Tensor]) -> list[Tensor]:
    """Per layer, the largest |value| of each down_proj input channel over the calibration batches."""
    inner = _layers(model, "smooth_down_proj_")
    maxima: list[Tensor | None] = [None] * len(inner.layers)
    hooks = []
    for i, layer in enumerate(inner.layers):
        def record(mod, args, i=i):
            a = args[0].detach().abs().flatten(0, -2).amax(0).float()
            maxima[i] = a if maxima[i] is None else torch.maximum(maxima[i], a)
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(record))
    try:
        for batch in calibration:
            model(batch)
    finally:
        for h in hooks:
            h.remove()
    if any(m is None for m in maxima):
        raise ValueError("smooth_down_proj_: the calibration batches never reached every down_proj; pass token id "
                         "batches the model runs on")
    return maxima


@torch.no_grad()
def smooth_down_proj_(model: nn.Module, calibration: Iterable[Tensor], alpha: float = DEFAULT_SMOOTH_ALPHA
                      ) -> nn.Module:
    """Scale each down_proj input channel j by 1 / s_j, s_j = max|x_j|^alpha over the calibration
    (normalized to a geometric mean of 1), folded into up_proj's rows and down_proj's columns: the
    function is unchanged. Run it on the float model before rotate_ (QuaRot(smooth=alpha) does)."""
    if not 0.0 < float(alpha) <= 1.0:
        raise ValueError(f"smooth_down_proj_: alpha must be in (0, 1], got {alpha}")
    calibration = list(calibration) if calibration is not None else []
    if not calibration:
        raise ValueError("smooth_down_proj_ needs calibration batches (token ids) to measure the down_proj inputs")
    inner = _layers(model, "smooth_down_proj_")
    for i, (layer, amax) in enumerate(zip(inner.layers, down_proj_input_max(model, calibration))):
        if not torch.isfinite(amax).all():
            raise ValueError(f"smooth_down_proj_: layer {i}'s down_proj input has NaN/Inf values on the calibration")
        s = amax.double().clamp_min(1e-5) ** float(alpha)
        s = s / s.log().mean().exp()
        up, down = layer.mlp.up_proj, layer.mlp.down_proj
        up.weight.copy_((up.weight.double() / s[:, None]).to(up.weight.dtype))
        if up.bias is not None:
            up.bias.copy_((up.bias.double() / s).to(up.bias.dtype))
        down.weight.copy_((down.weight.double() * s[None, :]).to(down.weight.dtype))
    return model
