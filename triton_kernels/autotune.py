"""A small autotuner for the Triton kernels: pick a launch config per (kernel, shape key), timed on
the GPU once and remembered per GPU name in a JSON file.

Why not triton.autotune: its timer (do_bench) needs CUDA, and under TRITON_INTERPRET=1 (the test
suite, CPU tensors) timing would only measure the interpreter. Here, on CPU tensors or under the
interpreter, `pick` returns the kernel's fixed default config without timing. On a GPU it times each
candidate with CUDA events (median of a few runs), keeps the fastest, and writes it to
$TORCH_LOWBIT_CACHE/triton_autotune.json (else ~/.cache/torch_lowbit/triton_autotune.json) under
"<GPU name> / triton <version> / configs v<CONFIG_VERSION>"; the file is read once per process.

Keys are strings built by the caller from (M bucket, N, K, ...): `m_bucket` rounds M up to a power
of two so one decode step and the next share a tuned config.

Before timing a key, every candidate is compiled at once on a thread pool (Triton's
AsyncCompileMode; the compiler and ptxas run outside the GIL), so tuning costs about one compile's
time rather than the sum of ~20. TORCH_LOWBIT_AUTOTUNE=0 turns timing off (the fixed defaults, as
without a GPU): for correctness runs that would otherwise spend their time compiling candidates.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CACHE_FILE = "triton_autotune.json"
# Bumped when the config fields or the kernels behind them change (2: STAGE; 3: lut4's own GEMV kernel;
# 4: word-wise lut4 / codebook / TCQ kernels for both kinds, per-kernel tile spaces; 5: gcb on the
# word-wise lowbit kernel, dot defaults that fit every activation dtype), so
# configs tuned by an older version are not read.
CONFIG_VERSION = 5

Config = dict  # launch kwargs: BLOCK_* / SPLIT_K constexprs plus num_warps, num_stages

_lock = threading.Lock()
_cache: Optional[dict] = None  # {device key: {kernel name: {shape key: config}}}


def m_bucket(m: int) -> int:
    """M rounded up to a power of two, capped at 1024 (beyond that tiles are full anyway)."""
    return min(1 << max(0, (m - 1).bit_length()), 1024)


def cache_path() -> Path:
    from torch_lowbit.core.cache import cache_dir
    return cache_dir() / CACHE_FILE


@functools.lru_cache(maxsize=None)
def _device_key(device: torch.device) -> str:
    import triton
    return f"{torch.cuda.get_device_name(device)} / triton {triton.__version__} / configs v{CONFIG_VERSION}"


def _load() -> dict:
    global _cache
    if _cache is None:
        try:
            _cache = json.loads(cache_path().read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # first run, or a torn file: tune again
            _cache = {}
    return _cache


def _save(device_key: str, kernel: str, key: str, config: Config) -> None:
    # Merge into what is on disk now (another process may have tuned other shapes), then replace
    # the file atomically so a reader never sees half a file.
    path = cache_path()
    try:
        on_disk = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        on_disk = {}
    on_disk.setdefault(device_key, {}).setdefault(kernel, {})[key] = config
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(on_disk, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def time_us(fn: Callable[[], object], warmup: int = 3, repeats: int = 10) -> float:
    """Median µs of fn() on the current CUDA stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def enabled() -> bool:
    return os.environ.get("TORCH_LOWBIT_AUTOTUNE", "1") != "0"


def precompile(candidates: Sequence[Config], run: Callable[..., object], workers: Optional[int] = None) -> None:
    """Compile every candidate concurrently: run(config, warmup=True) under Triton's AsyncCompileMode
    only submits the compile; leaving the mode waits for all. A candidate that fails to compile is
    left for the timing loop to skip; without AsyncCompileMode (older Triton) nothing happens here."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    with ThreadPoolExecutor(max_workers=workers or min(len(candidates), os.cpu_count() or 1) or 1) as pool, \
            AsyncCompileMode(pool, ignore_errors=True):
        for cfg in candidates:
            try:
                run(cfg, warmup=True)
            except Exception:  # noqa: BLE001 - e.g. a config this GPU rejects: timed (and skipped) later
                pass


def pick(kernel: str, key: str, candidates: Sequence[Config], default: Config,
         run: Callable[..., object], device: torch.device) -> Config:
    """The config to launch `kernel` with for this shape key.

    candidates: the search space (already filtered to configs valid for this shape); default: the
    config used without a GPU timer; run(config, warmup=False): launches the kernel once with that
    config on the real inputs (it must have no side effect besides writing its output); with
    warmup=True it only compiles it (see precompile)."""
    if INTERPRET or device.type != "cuda" or not enabled():
        return default  # no timer here
    dkey = _device_key(device)
    with _lock:
        hit = _load().get(dkey, {}).get(kernel, {}).get(key)
    if hit is not None:
        return hit  # also while a CUDA graph is captured: the warm-up before capture tuned it
    if _capturing():
        return default  # timing would break the capture
    precompile(candidates, run)
    best, best_us = default, float("inf")
    for cfg in candidates:
        try:
            us = time_us(lambda: run(cfg))
        except Exception:  # e.g. out of shared memory / registers for this GPU: not a candidate
            continue
        if us < best_us:
            best, best_us = cfg, us
    with _lock:
        _load().setdefault(dkey, {}).setdefault(kernel, {})[key] = best
        try:
            _save(dkey, kernel, key, best)
        except OSError:  # read-only home: keep the winner for this process only
            pass
    return best


def reset_cache_for_tests() -> None:
    """Forget the configs loaded from disk (tests point $TORCH_LOWBIT_CACHE elsewhere)."""
    global _cache
    with _lock:
        _cache = None
