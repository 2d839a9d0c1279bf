"""QuaRot as one recipe: rotate, round the weights, the activations and the KV cache.

    tl.quantize_(model, tl.QuaRot(weights="q4_0", acts=4, kv=4, rounding="gptq"), calibration=batches)
    tl.quantize_(model, tl.QuaRot.parse("W4A4KV4"), calibration=batches)     # the CLI's --quarot

Steps, in QuaRot's order: rotate_ (function unchanged), quantize_ the weights of the rotated model
(GPTQ sees the rotated inputs), quantize_activations_ (per-token, clip ratio searched on the
calibration), and the KV-cache setting recorded on model.config (KV_CONFIG_KEY) where
CompiledGenerator, the perplexity evaluation and checkpoints find it (kv_cache_for builds the cache).
rotate=False runs the same rounding without the rotation (the "without rotation" column).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Optional, Union

from torch import Tensor, nn

KV_CONFIG_KEY = "lowbit_kv_cache"  # model.config attribute: {"bits", "group", "residual_length", "rotate_keys"}
SMOOTH_WINDOWS = 8  # calibration windows whose down_proj inputs set the smoothing scales
DEFAULT_W4 = "q4_0"  # best 4-bit perplexity here; QuaRot's per-channel W4 is weights="int4_pc"


@dataclasses.dataclass(frozen=True)
class QuaRot:
    """weights: a registered format (None keeps them float); acts: per-token activation bits (8, 4,
    3; None keeps them float); kv: KV-cache bits (4 or 8; None keeps it float); rounding of the
    weights ("gptq" needs calibration, "rtn"); seed of the rotation; rotate=False skips it; smooth=alpha
    smooths each down_proj input on the calibration first (rotations/smooth.py; 0.25 measured best);
    act_block=16 / 32 gives activations one scale per block of that many features instead of per token
    (16: two-level scales inside blocks of 32; both rounded in the CPU kernels; W16A4 ~1.3x fp32 at 16 on
    SmolLM2 where per token gives 1.54x, docs/quarot.md)."""

    weights: Optional[Union[str, object]] = DEFAULT_W4
    acts: Optional[int] = 4
    kv: Optional[int] = 4
    rounding: str = "gptq"
    seed: int = 0
    rotate: bool = True
    act_symmetric: bool = True
    kv_group: int = 64
    kv_residual: int = 0  # QuaRot rounds every cached token; >0 keeps the last ones exact (KIVI)
    smooth: Optional[float] = None  # SmoothQuant exponent for the down_proj inputs before rotating (0.25)
    act_block: int = 0  # 0: one activation scale per token (QuaRot); 16 / 32: per block of features (NVFP4 / MXINT4-style)
    sequential: bool = False  # calibrate the weights layer by layer on the quantized layers' outputs (GPTQ's protocol)
    is_recipe = True  # quantize_(model, QuaRot(...)) hands the model to apply()

    @classmethod
    def parse(cls, spec: str, **overrides) -> "QuaRot":
        """'W4A4KV4', 'W4A8KV8', 'W16A4', 'W4A16KV16', ... (16 = keep float; KV omitted = float)."""
        m = re.fullmatch(r"W(\d+)A(\d+)(?:KV(\d+))?", spec.strip().upper())
        if not m:
            raise ValueError(f"QuaRot spec {spec!r}: expected W<bits>A<bits>[KV<bits>], e.g. W4A4KV4 or W16A8")
        w, a, kv = (int(g) if g else 16 for g in m.groups())
        if w not in (4, 16):
            raise ValueError(f"QuaRot spec {spec!r}: W must be 4 or 16 (pass weights=<format> for other formats)")
        fields = {"weights": DEFAULT_W4 if w == 4 else None, "acts": None if a == 16 else a,
                  "kv": None if kv == 16 else kv}
        fields.update(overrides)
        return cls(**fields)

    def label(self) -> str:
        w = "W16" if self.weights is None else f"W[{self.weights}]"
        return f"{w}A{self.acts or 16}KV{self.kv or 16}" + ("" if self.rotate else " (no rotation)") + \
            (f" (down_proj smoothed, alpha {self.smooth})" if self.smooth is not None else "") + \
            (f" (activation blocks of {self.act_block})" if self.act_block and self.acts else "")

    def apply(self, model: nn.Module, *, calibration: Optional[Iterable[Tensor]] = None, progress: bool = True,
              **quantize_kwargs) -> nn.Module:
        from .formats.kv import check_kv_config
        from .core.activations import check_act_bits, check_act_block
        from .nn.act_quant import quantize_activations_
        from .nn.quantize import quantize_
        from .rotations.model import rotate_
        from .rotations.smooth import smooth_down_proj_
        calibration = list(calibration) if calibration is not None else None
        if self.weights is not None and self.rounding != "rtn" and not calibration:
            raise ValueError(f"QuaRot(rounding={self.rounding!r}) needs calibration batches; pass calibration=... "
                             "or rounding='rtn'")
        if self.acts is not None:
            check_act_bits(self.acts)
            check_act_block(self.act_block, bits=self.acts if self.act_symmetric else None)
        if self.kv is not None:
            cfg = model.config.get_text_config() if hasattr(model, "config") else None
            if cfg is None:
                raise ValueError("QuaRot(kv=...) needs a transformers model (its config names the heads)")
            check_kv_config(self.kv, self.kv_group, getattr(cfg, "head_dim", None)
                            or cfg.hidden_size // cfg.num_attention_heads)
        if self.smooth is not None:
            if not calibration:
                raise ValueError("QuaRot(smooth=...) needs calibration batches; pass calibration=... or smooth=None")
            smooth_down_proj_(model, calibration[:SMOOTH_WINDOWS], alpha=self.smooth)
        if self.rotate:
            rotate_(model, seed=self.seed)
        if self.weights is not None:
            quantize_(model, self.weights, calibration=calibration, rounding=self.rounding, progress=progress,
                      sequential=self.sequential and self.rounding != "rtn", **quantize_kwargs)
        if self.acts is not None:
            quantize_activations_(model, self.acts, symmetric=self.act_symmetric, block=self.act_block,
                                  calibration=calibration[:2] if calibration else None)
        if self.kv is not None:
            set_kv_cache_config(model, {"bits": self.kv, "group": self.kv_group,
                                        "residual_length": self.kv_residual, "rotate_keys": self.rotate})
        return model


def set_kv_cache_config(model: nn.Module, config: Optional[dict]) -> None:
    setattr(model.config, KV_CONFIG_KEY, dict(config) if config else None)


def kv_cache_config(model: nn.Module) -> Optional[dict]:
    return getattr(getattr(model, "config", None), KV_CONFIG_KEY, None)


def kv_cache_for(model: nn.Module, max_cache_len: int):
    """A fresh QuantizedKVCache as the model's recorded KV setting asks, or None (float cache)."""
    cfg = kv_cache_config(model)
    if not cfg:
        return None
    from .kv_cache import QuantizedKVCache
    return QuantizedKVCache(model.config, max_cache_len, bits=cfg["bits"], group=cfg["group"],
                            residual_length=cfg["residual_length"], rotate_keys=cfg.get("rotate_keys", True))
