"""tl.set_num_threads / get_num_threads / threading_info (torch_lowbit/ops/threads.py): the scheduler and
thread count switch at run time, and every setting computes the same bytes."""
import os
import subprocess
import sys

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.ops import has_cpu_extension

needs_extension = pytest.mark.skipif(not has_cpu_extension(), reason="the C++ extension is not loaded")


@pytest.fixture
def restore_threading():
    from torch_lowbit.ops import threads
    before, torch_threads, chosen = tl.threading_info(), torch.get_num_threads(), dict(threads._chosen)
    yield
    torch.set_num_threads(torch_threads)
    if before["scheduler"] == "pool":
        fixed = before["threads"] if before["threads"] != torch_threads else None
        tl.set_num_threads(fixed, scheduler="pool")
    elif before["scheduler"] == "openmp":
        tl.set_num_threads(scheduler="openmp")
    threads._chosen.update(chosen)


def _outputs(seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)  # the layers' biases
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for fmt, n, k in (("q4_0", 97, 256), ("int2_g64", 61, 320), ("vq2", 80, 256)):
        lin = torch.nn.Linear(k, n)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        q = tl.QuantLinear.from_linear(lin, fmt)
        for m in (1, 7):
            outs.append(q(torch.randn(m, k, generator=gen)))
    return outs


@needs_extension
def test_the_scheduler_and_count_switch_at_run_time_with_the_same_outputs(restore_threading):
    seed = int.from_bytes(os.urandom(2), "little")
    torch.set_num_threads(2)
    tl.set_num_threads(scheduler="openmp")
    assert tl.threading_info() == {"scheduler": "openmp", "threads": 2, "torch_threads": 2}
    reference = _outputs(seed)
    tl.set_num_threads(3)  # more threads than torch's: the pool's own count
    assert tl.threading_info() == {"scheduler": "pool", "threads": 3, "torch_threads": 2}
    assert tl.get_num_threads() == 3
    for got, want in zip(_outputs(seed), reference):
        assert torch.equal(got, want)
    torch.set_num_threads(1)
    tl.set_num_threads(None)  # the pool, following torch's count
    assert tl.threading_info() == {"scheduler": "pool", "threads": 1, "torch_threads": 1}
    for got, want in zip(_outputs(seed), reference):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kwargs, message", [
    ({"scheduler": "fibers"}, "unknown scheduler"),
    ({"threads": 0}, "from 1 to 1024"),
    ({"threads": True}, "from 1 to 1024"),
    ({"threads": 2.0}, "from 1 to 1024"),
    ({"threads": 2, "scheduler": "openmp"}, "torch.set_num_threads"),
])
def test_bad_settings_are_clear_errors(kwargs, message, restore_threading):
    before = tl.threading_info()
    with pytest.raises(ValueError, match=message):
        tl.set_num_threads(**kwargs)
    assert tl.threading_info() == before


def test_without_the_extension_the_count_is_torchs():
    script = ("import torch, torch_lowbit as tl; tl.set_num_threads(1); i = tl.threading_info(); "
              "assert i == {'scheduler': 'torch', 'threads': 1, 'torch_threads': 1}, i; print('ok')")
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TORCH_LOWBIT_NO_EXTENSION": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@needs_extension
def test_kernels_on_the_pool_gives_the_kernels_torchs_threads_and_restores(restore_threading):
    from torch_lowbit.ops.threads import kernels_on_the_pool
    torch.set_num_threads(2)
    tl.set_num_threads(None)
    with kernels_on_the_pool():
        assert tl.threading_info() == {"scheduler": "pool", "threads": 2, "torch_threads": 1}
    assert tl.threading_info() == {"scheduler": "pool", "threads": 2, "torch_threads": 2}
    assert tl.get_num_threads() == 2 and torch.get_num_threads() == 2
    tl.set_num_threads(3)
    with pytest.raises(RuntimeError, match="inside"):
        with kernels_on_the_pool():
            assert tl.threading_info() == {"scheduler": "pool", "threads": 3, "torch_threads": 1}
            raise RuntimeError("inside")
    assert tl.threading_info() == {"scheduler": "pool", "threads": 3, "torch_threads": 2}
    tl.set_num_threads(scheduler="openmp")  # the user's choice: left alone
    with kernels_on_the_pool():
        assert tl.threading_info() == {"scheduler": "openmp", "threads": 2, "torch_threads": 2}


@needs_extension
def test_kernels_on_the_pool_by_default_and_openmp_again_after():
    """Without a choice of the user's (no set_num_threads, no TORCH_LOWBIT_THREADS), the kernels run on
    OpenMP by default and on the pool inside the context."""
    script = ("import torch, torch_lowbit as tl\nfrom torch_lowbit.ops.threads import kernels_on_the_pool\n"
              "torch.set_num_threads(2)\nassert tl.threading_info()['scheduler'] == 'openmp'\n"
              "with kernels_on_the_pool():\n    i = tl.threading_info()\n"
              "    assert i == {'scheduler': 'pool', 'threads': 2, 'torch_threads': 1}, i\n"
              "assert tl.threading_info() == {'scheduler': 'openmp', 'threads': 2, 'torch_threads': 2}\nprint('ok')")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOWBIT_THREADS", "TORCH_LOWBIT_POOL_THREADS",
                                                            "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
