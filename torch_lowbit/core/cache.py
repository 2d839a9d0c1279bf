"""Where torch_lowbit keeps derived files (model conversions, autotune results): bottom layer."""
from __future__ import annotations

import json
import os
from pathlib import Path


def cache_dir() -> Path:
    """$TORCH_LOWBIT_CACHE, else ~/.cache/torch_lowbit (created on first use)."""
    d = Path(os.environ.get("TORCH_LOWBIT_CACHE", Path.home() / ".cache" / "torch_lowbit"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def read_json(name: str) -> dict:
    """The JSON object in <cache>/name, or {} when it is missing, unreadable or not an object."""
    try:
        table = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def write_json(name: str, table: dict) -> None:
    """Writes <cache>/name whole or not at all (a temporary file, then a rename)."""
    path = cache_dir() / name
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    os.replace(tmp, path)
