"""What a benchmark ran on, for the first line of its output: CPU model, ISA path, date, commit.
Numbers from different CPUs or paths are not comparable, so every table names both."""
from __future__ import annotations

import datetime
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from ..ops import cpu_extension, cpu_model

_REPO = Path(__file__).resolve().parents[2]


def available_paths() -> list[str]:
    """The CPU kernel paths this machine can run, best first (TORCH_LOWBIT_CPU_MAX_PATH caps them)."""
    return list(cpu_extension().available_cpu_paths())


def active_path() -> str:
    """The path the kernels run now (the best one, or TORCH_LOWBIT_CPU_PATH / use_backend's)."""
    return cpu_extension().get_cpu_path()


def check_paths(paths: Sequence[str]) -> None:
    """ValueError naming the paths this CPU has, for a path name it cannot run (or no such path)."""
    have = available_paths()
    bad = [p for p in paths if p not in have]
    if bad:
        raise ValueError(f"CPU path {', '.join(bad)} cannot run here; this CPU ({cpu_model()}) has: "
                         f"{' '.join(have)}")


def git_commit() -> Optional[str]:
    """Short commit of the torch_lowbit checkout, "+changes" when tracked files differ from it; None
    outside a git checkout (an installed wheel: the enclosing folder's repository is not ours)."""
    if not (_REPO / ".git").exists():
        return None
    try:
        run = dict(cwd=_REPO, capture_output=True, text=True, timeout=10)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run)
        return head.stdout.strip() + ("+changes" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_line() -> str:
    """One line: CPU model, the active ISA path (and the others this CPU has), date, commit, torch."""
    import torch

    from ..version import __version__
    commit = git_commit()
    return (f"CPU: {cpu_model()}; ISA path: {active_path()} (available: {' '.join(available_paths())}); "
            f"date: {datetime.date.today().isoformat()}; torch_lowbit {__version__}"
            f"{f' commit {commit}' if commit else ''}; torch {torch.__version__}")


def gpu_line() -> str:
    """One line: the CUDA GPU, its driver (from nvidia-smi where it runs), date, commit, torch, triton."""
    import torch

    from ..version import __version__
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        driver = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    commit = git_commit()
    return (f"GPU: {torch.cuda.get_device_name()}; driver {driver}; date: {datetime.date.today().isoformat()}; "
            f"torch_lowbit {__version__}{f' commit {commit}' if commit else ''}; torch {torch.__version__}; "
            f"triton {triton_version}")
