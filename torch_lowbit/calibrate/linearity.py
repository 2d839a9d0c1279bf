"""Data-free layer sensitivities by the linearity theorem (HIGGS, Malinovskii et al. 2024): for small
relative weight errors t_l² = ‖ΔW_l‖² / ‖W_l‖², the loss of a perturbed model grows as Σ_l a_l t_l².
So a_l is measured once per layer, and any quantizer's predicted loss is a_l times its relative error.

Measured here without a dataset: the model samples its own text (temperature 1 from the BOS token),
its next-token distributions on that text are the reference, and for each unit (a layer, or the
layers quantized as one fused module) and each noise level t, Gaussian noise of relative norm t is
added to every row of every member's weight (`relative_noise`); a_l is the least-squares slope of the
mean per-token KL divergence from the reference against t² (through the origin). Far from the linear
regime (2-bit formats: t² ≈ 0.07) the KL bends up: `loss_curves` fits a_l t² + c_l t⁴ to the same
measurements, which MSQ uses by default (docs/formats/mixed.md: the 2.875 bpw plan's perplexity).

A unit inside a decoder block costs one pass through that block and those after it (the blocks'
inputs are recorded on the clean model and the replay checked against the full forward), not a
whole forward; a model whose blocks cannot be replayed runs the whole forward per noise level."""
from __future__ import annotations

import logging
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

log = logging.getLogger("torch_lowbit")

# relative norms spanning the palette's 2- to 4-bit errors (t² 0.01 .. 0.09): fitted over that range, the
# slope also charges the curvature of the larger errors (SmolLM2, MSQ at 2.875 bpw: perplexity 29.74
# with these three levels, 30.47 with (0.1, 0.2); docs/formats/mixed.md)
DEFAULT_NOISE = (0.1, 0.2, 0.3)


@torch.no_grad()
def self_generated_tokens(model: nn.Module, sequences: int = 8, length: int = 128, seed: int = 0) -> Tensor:
    """int64 [sequences, length]: text the model samples itself (temperature 1, no top-k / top-p),
    each sequence starting at the model's BOS token (0 without one), with end-of-text suppressed."""
    if sequences < 1 or length < 2:
        raise ValueError(f"self_generated_tokens: need sequences >= 1 and length >= 2, got {sequences}, {length}")
    config = getattr(model, "config", None)
    bos = getattr(config, "bos_token_id", None)
    bos = bos[0] if isinstance(bos, (list, tuple)) else bos
    device = next(model.parameters()).device
    ids = torch.full((sequences, 1), int(bos) if bos is not None else 0, dtype=torch.long, device=device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if hasattr(model, "generate"):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=length - 1, min_new_tokens=length - 1,
                                 pad_token_id=int(bos) if bos is not None else 0)
            return out[:, :length].cpu()
        for _ in range(length - 1):  # a model without generate(): one full forward per token
            logits = _logits(model(ids))[:, -1].float()
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1)], 1)
        return ids.cpu()


class _Replay:
    """Runs a Llama-like model from the input of block i: records each block's call on the clean
    forward, then block i .. end, the final norm and the head."""

    def __init__(self, model: nn.Module, tokens: Tensor):
        self.model, self.tokens = model, tokens
        self.layers = self.norm = self.head = None
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) and isinstance(getattr(inner, "norm", None), nn.Module) \
                and isinstance(getattr(model, "lm_head", None), nn.Module):
            self.layers, self.norm, self.head = layers, inner.norm, model.lm_head
        self.calls: list[Optional[tuple]] = []

    def clean_logits(self) -> Tensor:
        hooks = []
        if self.layers is not None:
            self.calls = [None] * len(self.layers)
            for i, layer in enumerate(self.layers):
                hooks.append(layer.register_forward_pre_hook(self._recorder(i), with_kwargs=True))
        try:
            logits = self.full()
        finally:
            for h in hooks:
                h.remove()
        if self.layers is not None and (any(c is None for c in self.calls) or
                                        not torch.allclose(self.from_block(0), logits, rtol=1e-4, atol=1e-4)):
            log.info("linearity sensitivities: this model's blocks do not replay; every noise level runs the "
                     "whole forward")
            self.layers = None
        return logits

    def _recorder(self, i):
        def hook(module, args, kwargs):
            if self.calls[i] is None:
                self.calls[i] = (args, kwargs)
        return hook

    def full(self) -> Tensor:
        return _logits(self.model(self.tokens, use_cache=False)).float()

    def block_of(self, fqn: str) -> Optional[int]:
        """The index of the block holding layer fqn, or None (outside the blocks, or no replay)."""
        if self.layers is None:
            return None
        prefix = next(name for name, m in self.model.named_modules() if m is self.layers) + "."
        if not fqn.startswith(prefix):
            return None
        index = fqn[len(prefix):].split(".", 1)[0]
        return int(index) if index.isdigit() else None

    def from_block(self, i: Optional[int]) -> Tensor:
        if i is None or self.layers is None:
            return self.full()
        args, kwargs = self.calls[i]
        h = args[0] if args else kwargs["hidden_states"]
        rest = args[1:]
        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        for layer in self.layers[i:]:
            out = layer(h, *rest, **kw)
            h = out[0] if isinstance(out, (tuple, list)) else out
        return self.head(self.norm(h)).float()


def relative_noise(w: Tensor, t: float, gen: torch.Generator) -> Tensor:
    """Gaussian noise of relative norm t on each row of w (so ‖ΔW‖ = t ‖W‖): the error a quantizer
    with per-row (or per-group) scales makes, proportional to each row's own size, not to the
    matrix's average."""
    g = torch.randn(w.shape, generator=gen).to(w.device, torch.float32)
    wf = w.detach().float()
    scale = t * wf.norm(dim=-1, keepdim=True) / g.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return (g * scale).to(w.dtype)


def _logits(out) -> Tensor:
    return out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)


def _reference(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(log p, p) of the clean model's logits, fp32."""
    logp = torch.log_softmax(logits.float(), -1)
    return logp, logp.exp()


def _kl(ref: tuple[Tensor, Tensor], logits: Tensor) -> float:
    """Mean over positions of KL(p_ref || p) (fp32 terms, an fp64 mean: the vocabulary-wide passes
    cost as much as a block at SmolLM2's size, so not in fp64)."""
    ref_logp, ref_p = ref
    logp = torch.log_softmax(logits.float(), -1)
    return float((ref_p * (ref_logp - logp)).sum(-1).double().mean())


@torch.no_grad()
def linearity_sensitivities(model: nn.Module, units: Mapping[str, Sequence[str]], *,
                            tokens: Optional[Tensor] = None, noise: Sequence[float] = DEFAULT_NOISE,
                            seed: int = 0, progress: bool = True) -> dict[str, float]:
    """{unit: a}: the linearity theorem's sensitivity of each unit (module doc). units: {name: the
    fqns of its nn.Linear layers}; tokens: int64 [batch, seq] to measure on (default: 8 sequences of
    128 tokens the model samples itself)."""
    kls = kl_under_noise(model, units, tokens=tokens, noise=noise, seed=seed, progress=progress)
    return {name: fit_curve(noise, k, "linear")[0] for name, k in kls.items()}


def loss_curves(model: nn.Module, units: Mapping[str, Sequence[str]], *, tokens: Optional[Tensor] = None,
                noise: Sequence[float] = DEFAULT_NOISE, seed: int = 0, fit: str = "quadratic",
                progress: bool = True) -> dict[str, tuple[float, float]]:
    """{unit: (a, c)}: each unit's KL increase as a curve in the relative error d = t²,
    KL(d) ≈ a·d + c·d² (fit_curve), measured as linearity_sensitivities measures a."""
    if fit not in FITS:
        raise ValueError(f"unknown fit {fit!r}; choose one of {', '.join(FITS)}")
    kls = kl_under_noise(model, units, tokens=tokens, noise=noise, seed=seed, progress=progress)
    return {name: fit_curve(noise, k, fit) for name, k in kls.items()}


FITS = ("quadratic", "linear")


def fit_curve(noise: Sequence[float], kls: Sequence[float], fit: str = "quadratic") -> tuple[float, float]:
    """(a, c) of KL ≈ a·t² + c·t⁴ over the noise levels t, least squares, neither negative. "linear":
    c = 0, a the slope through the origin (HIGGS's straight line); "quadratic": the curvature too,
    which charges a 2-bit format's error (t² ≈ 0.07) more than the line through small t does (the
    line where either coefficient comes out negative, or with one noise level)."""
    t2 = torch.tensor([float(t) for t in noise], dtype=torch.float64) ** 2
    y = torch.tensor([float(k) for k in kls], dtype=torch.float64)
    slope = max(float((y * t2).sum() / (t2 * t2).sum()), 0.0)
    if fit == "linear" or len(t2) < 2:
        return slope, 0.0
    basis = torch.stack([t2, t2 * t2], 1)
    a, c = torch.linalg.lstsq(basis, y.unsqueeze(1)).solution.squeeze(1).tolist()
    if a < 0 or c < 0:  # the data bend down, or start below zero (noise in the KLs): the line
        return slope, 0.0
    return float(a), float(c)


@torch.no_grad()
def kl_under_noise(model: nn.Module, units: Mapping[str, Sequence[str]], *, tokens: Optional[Tensor] = None,
                   noise: Sequence[float] = DEFAULT_NOISE, seed: int = 0, progress: bool = True) -> dict[str, list[float]]:
    """{unit: [KL at each noise level]}: the mean per-token KL divergence from the clean model when
    Gaussian noise of relative norm t is added to every row of the unit's weights (module doc)."""
    noise = tuple(float(t) for t in noise)
    if not noise or any(not 0 < t < 1 for t in noise):
        raise ValueError(f"noise levels must be relative norms in (0, 1), got {noise}")
    modules = dict(model.named_modules())
    for name, members in units.items():
        for fqn in members:
            if not isinstance(modules.get(fqn), nn.Linear):
                raise ValueError(f"linearity_sensitivities: {fqn} (unit {name}) is not an nn.Linear of the model")
    was_training = model.training
    model.eval()
    try:
        if tokens is None:
            tokens = self_generated_tokens(model, seed=seed)
        device = next(model.parameters()).device
        replay = _Replay(model, tokens.to(device))
        ref = _reference(replay.clean_logits())
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        out = {}
        for name, members in tqdm(units.items(), desc="linearity sensitivities", disable=None if progress else True,
                                  leave=False):
            layers = [modules[f] for f in members]
            blocks = [replay.block_of(f) for f in members]
            start = None if any(b is None for b in blocks) else min(blocks)
            kls = []
            for t in noise:
                saved = [m.weight.detach().clone() for m in layers]
                try:
                    for m in layers:
                        m.weight.add_(relative_noise(m.weight, t, gen))
                    kls.append(_kl(ref, replay.from_block(start)))
                finally:
                    for m, s in zip(layers, saved):
                        m.weight.copy_(s)
            out[name] = kls
        return out
    finally:
        model.train(was_training)


def unit_name(members: Sequence[str]) -> str:
    """A unit's name: its one fqn, or the shared prefix with the members' last names joined by '+'
    (model.layers.0.self_attn.q_proj+k_proj+v_proj)."""
    if len(members) == 1:
        return members[0]
    prefix = members[0].rpartition(".")[0]
    if all(m.rpartition(".")[0] == prefix for m in members):
        return f"{prefix}.{'+'.join(m.rpartition('.')[2] for m in members)}"
    return "+".join(members)

