"""How many threads torch_lowbit's CPU kernels use, and how they are scheduled.

    tl.set_num_threads(2)                    # the kernels on the work-claiming pool, 2 threads
    tl.set_num_threads(scheduler="openmp")   # the kernels on torch's OpenMP threads (torch.set_num_threads)
    tl.get_num_threads(), tl.threading_info()

Two schedulers (csrc/common/parallel.h). "openmp" splits each kernel's rows statically over torch's
OpenMP threads and waits at the end for the slowest: beside another busy program, the thread placed on
the busy core holds up every call. "pool" cuts the rows into several chunks per thread that the
calling thread and the pool's workers claim; the caller waits only for chunks a worker actually took,
so a descheduled worker costs nothing (docs/kernels/cpu.md, "Threading and a busy core").

The environment sets the same on first use (TORCH_LOWBIT_THREADS=pool|openmp|auto,
TORCH_LOWBIT_POOL_THREADS=N); a call here overrides it for the rest of the process. Without the C++
extension the CPU ops are torch references on torch's own threads: the count is torch.set_num_threads's.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

from .extension import cpu_extension, has_cpu_extension

SCHEDULERS = ("pool", "openmp")
_chosen = {"scheduler": None}  # what set_num_threads last chose (None: never called)


def set_num_threads(threads: Optional[int] = None, *, scheduler: str = "pool") -> None:
    """Run torch_lowbit's CPU kernels on `threads` threads (None: follow torch.get_num_threads())
    with `scheduler` ("pool" or "openmp"; "openmp" always uses torch's count). Takes effect at the
    next kernel call; torch's own ops keep torch.set_num_threads's count."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024):
        raise ValueError(f"threads must be a count from 1 to 1024 (or None: torch's count), got {threads!r}")
    if scheduler == "openmp" and threads is not None:
        raise ValueError("the openmp scheduler runs on torch's threads: set their count with torch.set_num_threads, "
                         "or choose scheduler='pool' for a count of torch_lowbit's own")
    _chosen["scheduler"] = scheduler
    if not has_cpu_extension():  # the reference ops run on torch's threads
        if threads is not None:
            torch.set_num_threads(threads)
        return
    cpu_extension().set_threading(scheduler, threads or 0)


def openmp_chosen() -> bool:
    """Whether the user asked for the openmp scheduler (set_num_threads or TORCH_LOWBIT_THREADS)."""
    if _chosen["scheduler"] is not None:
        return _chosen["scheduler"] == "openmp"
    return os.environ.get("TORCH_LOWBIT_THREADS", "").strip().lower() == "openmp"


def get_num_threads() -> int:
    """How many threads the next CPU kernel call may use."""
    if not has_cpu_extension():
        return torch.get_num_threads()
    ext = cpu_extension()
    fixed = ext.pool_threads() if ext.threading() == "pool" else 0
    return fixed or torch.get_num_threads()


def threading_info() -> dict:
    """{"scheduler": "pool" | "openmp" | "torch" (no extension), "threads": the kernels' count,
    "torch_threads": torch's own} for reports and benchmark rows."""
    scheduler = cpu_extension().threading() if has_cpu_extension() else "torch"
    return {"scheduler": scheduler, "threads": get_num_threads(), "torch_threads": torch.get_num_threads()}


@contextlib.contextmanager
def kernels_on_the_pool() -> Iterator[None]:
    """torch's own ops on the calling thread, torch_lowbit's kernels on the pool with as many threads as
    torch had (or the count set with set_num_threads): no OpenMP thread spins beside the pool's
    workers, and a worker on a busy core delays nothing it has not claimed. For a decode step, where
    the quantized kernels are most of the time and torch's ops are small. Leaves the settings as they
    were; a no-op where the user chose the openmp scheduler, and without the extension."""
    if not has_cpu_extension() or openmp_chosen():
        yield
        return
    ext, torch_threads = cpu_extension(), torch.get_num_threads()
    scheduler, fixed = ext.threading(), ext.pool_threads()
    ext.set_threading("pool", fixed or torch_threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(torch_threads)
        ext.set_threading(scheduler, fixed if scheduler == "pool" else 0)
