"""The CPU kernels' two ways of threading (csrc/common/parallel.h): OpenMP's at::parallel_for and
torch_lowbit's work-claiming pool (TORCH_LOWBIT_THREADS=pool, or auto with OMP_WAIT_POLICY=passive)
give the same bytes: each kernel's rows (tiles, bands, blocks) are computed the same whoever runs
them. Each mode is read once per process, so each runs in a subprocess."""
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import sys, torch, torch_lowbit as tl
from torch_lowbit.ops import cpu_extension
assert cpu_extension().threading() == sys.argv[1], cpu_extension().threading()
torch.set_num_threads(2)
torch.manual_seed(int(sys.argv[2]))
gen = torch.Generator().manual_seed(int(sys.argv[2]))
for fmt, n, k in (("q4_0", 97, 256), ("iq4_nl", 300, 96), ("int2_g64", 61, 320), ("vq2", 80, 256), ("tcq2", 64, 256)):
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
    q = tl.QuantLinear.from_linear(lin, fmt)
    for m in (1, 5, 33):
        x = torch.randn(m, k, generator=gen)
        first = q(x)
        for _ in range(50):  # many jobs back to back: a race would show as a difference
            assert torch.equal(q(x), first), (fmt, m)
        print(fmt, m, first.double().sum().item().hex(), first.abs().max().item().hex())
"""


def _run(mode: str, seed: int) -> str:
    env = {**os.environ, "TORCH_LOWBIT_THREADS": mode}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(seed)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_pool_and_openmp_threading_give_the_same_outputs():
    seed = int.from_bytes(os.urandom(2), "little")
    assert _run("pool", seed) == _run("openmp", seed)


def test_unknown_threading_mode_is_a_clear_error():
    env = {**os.environ, "TORCH_LOWBIT_THREADS": "fibers"}
    done = subprocess.run([sys.executable, "-c", "import torch, torch_lowbit as tl; "
                           "tl.QuantLinear.from_linear(torch.nn.Linear(64, 32), 'q4_0')(torch.randn(3, 64))"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "TORCH_LOWBIT_THREADS" in done.stderr and "pool" in done.stderr


def test_pool_threads_run_the_kernels_beside_a_one_thread_torch():
    """TORCH_LOWBIT_POOL_THREADS=2 with torch.set_num_threads(1) (the shared-machine recipe): the pool is
    on, the kernels use 2 threads, and the outputs are the bytes of the 2-thread OpenMP run."""
    env = {**os.environ, "TORCH_LOWBIT_POOL_THREADS": "2"}
    env.pop("TORCH_LOWBIT_THREADS", None)
    one_thread_torch = SCRIPT.replace("torch.set_num_threads(2)", "torch.set_num_threads(1)")
    done = subprocess.run([sys.executable, "-c", one_thread_torch, "pool", "5"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == _run("openmp", 5)


@pytest.mark.parametrize("env, message", [({"TORCH_LOWBIT_POOL_THREADS": "two"}, "from 1 to 1024"),
                                          ({"TORCH_LOWBIT_POOL_THREADS": "0"}, "from 1 to 1024"),
                                          ({"TORCH_LOWBIT_POOL_THREADS": "2", "TORCH_LOWBIT_THREADS": "openmp"},
                                           "unset one of them")])
def test_bad_pool_thread_settings_are_clear_errors(env, message):
    full = {**os.environ, **env}
    done = subprocess.run([sys.executable, "-c", "import torch, torch_lowbit as tl; "
                           "tl.QuantLinear.from_linear(torch.nn.Linear(64, 64), 'q4_0')(torch.randn(2, 64))"],
                          env=full, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
