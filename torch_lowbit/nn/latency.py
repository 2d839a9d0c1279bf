"""Measured latency of one quantized layer per (format, layout, N x K, batch M) on this device, for
latency-constrained MSQ (nn/msq.py) and `python -m torch_lowbit bench latency`.

A measurement builds a QuantLinear of random N(0, 0.02) weights in the format (its default layout for
the device), with enough copies to exceed the last-level caches (`ROTATE_MIB`, at most `MAX_COPIES`:
the weights come from DRAM, as in a model's decode step), and times forward calls over the copies: the median of `rounds`
rounds of one call per copy. The table is cached in <cache>/latency.json per device key (CPU model,
ISA path, thread count and torch_lowbit version; or the CUDA device's name): numbers from another
machine, path or thread count are never reused."""
from __future__ import annotations

import statistics
import threading
import time
from typing import Sequence

import torch

from ..core.cache import read_json, write_json
from ..formats import Format
from ..version import __version__
from .linear import QuantLinear

CACHE_FILE = "latency.json"
ROTATE_MIB = 64
MAX_COPIES = 256  # a layer under 256 KiB is timed from the caches: its calls are overhead-bound anyway
_lock = threading.Lock()


def device_key(device: str = "cpu") -> str:
    """The device a latency belongs to (module doc)."""
    if device == "cpu":
        from ..ops import cpu_extension, cpu_model, has_cpu_extension
        path = cpu_extension().get_cpu_path() if has_cpu_extension() else "no-extension"
        return f"cpu|{cpu_model()}|{path}|{torch.get_num_threads()} threads|{__version__}"
    if device == "cuda":
        return f"cuda|{torch.cuda.get_device_name()}|{__version__}"
    raise ValueError(f"latency: device must be 'cpu' or 'cuda', got {device!r}")


def entry_key(fmt: Format, n: int, k: int, m: int) -> str:
    return f"{fmt.name}|{n}x{k}|M{m}"


@torch.no_grad()
def measure(fmt: Format, n: int, k: int, ms: Sequence[int] = (1,), device: str = "cpu", rounds: int = 7) -> dict[int, float]:
    """Seconds per forward call of a QuantLinear [n, k] in fmt at each batch m of ms (module doc):
    one layer built, then timed per m."""
    problem = fmt.shape_problem(n, k)
    if problem is not None:
        raise ValueError(f"latency: {fmt.name} cannot hold a {n}x{k} layer: {problem}")
    gen = torch.Generator().manual_seed(n * 7919 + k)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
    layer = QuantLinear.from_linear(lin.to(device), fmt)
    nbytes = max(1, sum(t.numel() * t.element_size() for t in layer.buffers()))
    copies = min(MAX_COPIES, max(1, -(-ROTATE_MIB * 2**20 // nbytes)))
    layers = [layer] + [_copy(layer) for _ in range(copies - 1)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {}
    for m in ms:
        x = torch.randn(m, k, generator=gen).to(device)
        for ql in layers[:2]:  # warm-up: first-call set-up, caches of prepared tiles
            ql(x)
        times = []
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            for ql in layers:
                ql(x)
            sync()
            times.append((time.perf_counter() - t0) / len(layers))
        out[m] = statistics.median(times)
    return out


def _copy(layer: QuantLinear) -> QuantLinear:
    import copy
    return copy.deepcopy(layer)


def layer_latency(fmt: Format, n: int, k: int, m: int = 1, device: str = "cpu", measure_missing: bool = True) -> float:
    """fmt's latency at [n, k] and batch m on this device: from the cached table, or measured and
    cached (measure_missing), else KeyError naming the command that measures it."""
    return layer_latencies(fmt, n, k, (m,), device, measure_missing)[m]


def layer_latencies(fmt: Format, n: int, k: int, ms: Sequence[int], device: str = "cpu",
                    measure_missing: bool = True) -> dict[int, float]:
    """layer_latency for several batch sizes, the missing ones measured on one built layer."""
    dev = device_key(device)
    with _lock:
        have = _read().get(dev, {})
        missing = [m for m in ms if entry_key(fmt, n, k, m) not in have]
        if missing:
            if not measure_missing:
                raise KeyError(f"no latency of {entry_key(fmt, n, k, missing[0])} for {dev}; measure it with "
                               "python -m torch_lowbit bench latency")
            measured = measure(fmt, n, k, missing, device)
            table = _read()  # another process may have added entries meanwhile
            table.setdefault(dev, {}).update({entry_key(fmt, n, k, m): s for m, s in measured.items()})
            write_json(CACHE_FILE, table)
            have = table[dev]
        return {m: float(have[entry_key(fmt, n, k, m)]) for m in ms}


def cached_table(device: str = "cpu") -> dict[str, float]:
    """This device's cached latencies {format|NxK|M: seconds}."""
    return dict(_read().get(device_key(device), {}))


def _read() -> dict[str, dict[str, float]]:
    return {d: {k: float(v) for k, v in e.items() if isinstance(v, (int, float))}
            for d, e in read_json(CACHE_FILE).items() if isinstance(e, dict)}
