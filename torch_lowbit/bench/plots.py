"""PNG figures of the benchmarks (matplotlib, from the `eval` extra; imported only when asked for)."""
from __future__ import annotations

from typing import Sequence


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("PNG output needs matplotlib: pip install 'torch_lowbit[eval]' (or matplotlib)") from e
    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt
    return plt


def roofline_png(rows: Sequence, dram_gbs: float, path: str, threads: int) -> str:
    """Roofline of `bench cpu` rows at one thread count: GFLOPS against arithmetic intensity
    (FLOPs per weight byte read). The sloped line is the measured DRAM read bandwidth; the flat
    line is the best throughput any kernel reached in this run (a measured, not a datasheet, ceiling)."""
    plt = _pyplot()
    rows = [r for r in rows if r.threads == threads]
    if not rows:
        raise ValueError(f"no benchmark rows at {threads} threads to plot")
    fig, ax = plt.subplots(figsize=(8, 5.5))
    points = {}
    for r in rows:
        n, k = map(int, r.shape.split("x"))
        points.setdefault(r.name, []).append((2.0 * r.m * n * k / r.weight_bytes, r.gflops(n, k)))
    peak = max(g for pts in points.values() for _, g in pts)
    ais = [a for pts in points.values() for a, _ in pts]
    lo, hi = min(ais) / 2, max(ais) * 2
    knee = peak / dram_gbs
    ax.plot([lo, knee, hi], [lo * dram_gbs, peak, peak], "k-", lw=1.2,
            label=f"DRAM {dram_gbs:.1f} GB/s / best measured {peak:.0f} GFLOPS")
    for name, pts in sorted(points.items()):
        pts.sort()
        ax.plot([a for a, _ in pts], [g for _, g in pts], "o-", ms=4, lw=0.8, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per weight byte)")
    ax.set_ylabel("GFLOPS")
    ax.set_title(f"CPU roofline, {threads} thread(s), weights streamed from DRAM")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
