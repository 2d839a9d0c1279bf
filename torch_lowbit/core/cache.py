"""Where torch_lowbit keeps derived files (model conversions, autotune results): bottom layer."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$TORCH_LOWBIT_CACHE, else ~/.cache/torch_lowbit (created on first use)."""
    d = Path(os.environ.get("TORCH_LOWBIT_CACHE", Path.home() / ".cache" / "torch_lowbit"))
    d.mkdir(parents=True, exist_ok=True)
    return d
