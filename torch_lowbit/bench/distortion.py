"""`python -m torch_lowbit bench distortion`: normalized MSE of every Q-Palette format on a standard
Gaussian matrix against the rate-distortion bound 2^(-2b), and how long quantizing took.
`python -m torch_lowbit bench weights --model smollm2|minilm`: the same error on a real model's
linear weights (the layers each format can hold)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from ..formats import formats, get_format
from ..formats.distortion import relative_error
from ..formats.palette import PaletteFormat


@dataclass
class DistortionRow:
    name: str
    bits: float
    mse: float
    seconds: float

    @property
    def bound(self) -> float:
        return 2.0 ** (-2 * self.bits)


def palette_formats() -> list[str]:
    names = [f for f in formats() if isinstance(get_format(f), PaletteFormat)]
    return sorted(names, key=lambda f: (get_format(f).prefix, get_format(f).bits))


@torch.no_grad()
def bench_distortion(names=None, rows: int = 4096, cols: int = 4096, seed: int = 0, progress=None):
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    out = []
    for name in names or palette_formats():
        fmt = get_format(name)
        t0 = time.perf_counter()
        mse = relative_error(fmt, w)  # quantize (most of the time) and dequantize
        seconds = time.perf_counter() - t0
        out.append(DistortionRow(name, fmt.bits_per_weight(), mse, seconds))
        progress(f"  {name}: normalized MSE {mse:.5f} ({seconds:.1f} s)")
    return out


def format_distortion_table(rows: list[DistortionRow], shape: str) -> str:
    lines = [f"standard Gaussian {shape}, normalized MSE = |W - Ŵ|² / |W|²", "",
             "| format | bits/weight | normalized MSE | bound 2^(-2b) | MSE / bound | quantize s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.bits:g} | {r.mse:.5f} | {r.bound:.5f} | {r.mse / r.bound:.2f} | {r.seconds:.1f} |")
    return "\n".join(lines)


def distortion_png(rows: list[DistortionRow], path: str) -> str:
    from .plots import _pyplot
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    bits = sorted({r.bits for r in rows})
    lo, hi = min(bits), max(bits)
    xs = [lo + (hi - lo) * i / 100 for i in range(101)]
    ax.plot(xs, [2 ** (-2 * b) for b in xs], "k--", lw=1, label="Gaussian bound 2^(-2b)")
    families = {}
    for r in rows:
        families.setdefault(get_format(r.name).prefix, []).append(r)
    for fam, rs in families.items():
        rs.sort(key=lambda r: r.bits)
        ax.plot([r.bits for r in rs], [r.mse for r in rs], "o-", ms=4, label=fam)
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight")
    ax.set_ylabel("normalized MSE")
    ax.set_title("Q-Palette formats on a standard Gaussian")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def model_linear_weights(model: str) -> list[tuple[str, torch.Tensor]]:
    """(name, fp32 weight) of a model's linear layers: "smollm2" (attention + MLP, no head) or
    "minilm" (the all-MiniLM-L6-v2 encoder's attention, intermediate and output projections)."""
    from ..eval import assets
    if model == "smollm2":
        m, _ = assets.load_smollm2()
        return [(n, mod.weight.detach()) for n, mod in m.named_modules()
                if isinstance(mod, torch.nn.Linear) and "lm_head" not in n]
    if model == "minilm":
        from safetensors.torch import load_file
        tensors = load_file(str(assets.minilm_safetensors()))
        return [(n, t.float()) for n, t in sorted(tensors.items())
                if n.endswith(".weight") and t.dim() == 2 and "embeddings" not in n]
    raise ValueError(f"unknown model {model!r}; choose smollm2 or minilm")


@torch.no_grad()
def bench_weights(model: str, names, progress=None) -> list[list[str]]:
    """Rows [format, bits/weight, layers, normalized MSE] for a model's linear weights, over the layers
    every listed format can hold (so the formats are compared on the same weights)."""
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    weights = model_linear_weights(model)
    fmts = [get_format(name) for name in names]
    held = [(n, w) for n, w in weights if all(f.shape_problem(*w.shape) is None for f in fmts)]
    rows = []
    for name, fmt in zip(names, fmts):
        err = total = 0.0
        for _, w in held:
            err += float(((fmt.dequantize(fmt.quantize(w)) - w) ** 2).sum())
            total += float((w ** 2).sum())
        mse = err / total if total else float("nan")
        rows.append([name, f"{fmt.bits_per_weight():.3f}", f"{len(held)}/{len(weights)}", f"{mse:.5f}"])
        progress(f"  {model} {name}: normalized MSE {mse:.5f} over {len(held)} layers")
    return rows
