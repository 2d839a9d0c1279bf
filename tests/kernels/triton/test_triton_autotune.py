"""The Triton autotuner: M buckets, concurrent precompilation, one timing per GPU, kept in the cache."""
import json

import pytest
import torch

from conftest import triton_available

SEED_FILE = "test_triton_kernels.py"  # split out of tests/test_triton_kernels.py: its seeds (conftest.stable_seed)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


# -- autotune ------------------------------------------------------------------------------------
def test_autotune_bucket_and_no_timing_without_gpu():
    from torch_lowbit.triton_kernels import autotune
    assert [autotune.m_bucket(m) for m in (1, 2, 3, 5, 17, 33, 512, 5000)] == [1, 2, 4, 8, 32, 64, 512, 1024]

    def run(cfg):
        raise AssertionError("no timing on CPU tensors / under the interpreter")

    default = {"BLOCK_N": 32}
    assert autotune.pick("k", "key", [{"BLOCK_N": 16}], default, run, torch.device("cpu")) is default


def test_autotune_precompiles_candidates_concurrently():
    """precompile calls run(cfg, warmup=True) for every candidate under Triton's AsyncCompileMode
    (where a launch in warmup only submits its compile to the pool) and swallows a candidate's
    failure, leaving it to the timing loop."""
    from triton.runtime import _async_compile

    from torch_lowbit.triton_kernels import autotune
    seen = []

    def run(cfg, warmup=False):
        mode = _async_compile.active_mode.get()
        assert warmup and mode is not None and mode.executor._max_workers == 2
        seen.append(cfg["BLOCK_N"])
        if cfg["BLOCK_N"] == 64:
            raise RuntimeError("out of resources")

    autotune.precompile([{"BLOCK_N": b} for b in (16, 32, 64, 128)], run, workers=2)
    assert seen == [16, 32, 64, 128] and _async_compile.active_mode.get() is None


def test_autotune_times_once_and_caches_per_gpu(tmp_path, monkeypatch):
    """The GPU branch with a stand-in timer: the fastest candidate wins, lands in the JSON file under
    the GPU's name, and later calls (and a fresh process) reuse it without timing."""
    from torch_lowbit.triton_kernels import autotune
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "INTERPRET", False)
    monkeypatch.setattr(autotune, "_capturing", lambda: False)
    monkeypatch.setattr(autotune, "_device_key", lambda device: "Fake GPU / triton 0")
    monkeypatch.setattr(autotune, "time_us", lambda fn: fn())
    autotune.reset_cache_for_tests()
    cands = [{"BLOCK_N": 16}, {"BLOCK_N": 32}, {"BLOCK_N": 64}, {"BLOCK_N": 128}]
    timed, compiled = [], []

    def run(cfg, warmup=False):
        if cfg["BLOCK_N"] == 128:
            raise RuntimeError("out of resources")  # a config this GPU cannot run is skipped
        if warmup:  # all compiles submitted before any timing
            assert not timed
            compiled.append(cfg["BLOCK_N"])
            return
        timed.append(cfg["BLOCK_N"])
        return {16: 9.0, 32: 3.0, 64: 5.0}[cfg["BLOCK_N"]]

    cuda = torch.device("cuda")
    try:
        monkeypatch.setenv("TORCH_LOWBIT_AUTOTUNE", "0")  # timing off: the default, nothing compiled
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) is cands[0] and not compiled
        monkeypatch.delenv("TORCH_LOWBIT_AUTOTUNE")
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) == {"BLOCK_N": 32}
        assert compiled == [16, 32, 64] and timed == [16, 32, 64]
        on_disk = json.loads((tmp_path / "triton_autotune.json").read_text())
        assert on_disk == {"Fake GPU / triton 0": {"lut4_gemv": {"m1_n64_k64": {"BLOCK_N": 32}}}}
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) == {"BLOCK_N": 32}
        # under CUDA-graph capture: the tuned config where the warm-up found one, else the default, untimed
        monkeypatch.setattr(autotune, "_capturing", lambda: True)
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) == {"BLOCK_N": 32}
        assert autotune.pick("lut4_gemv", "m2_n64_k64", cands, cands[0], run, cuda) is cands[0]
        assert timed == [16, 32, 64]
        monkeypatch.setattr(autotune, "_capturing", lambda: False)
        autotune.reset_cache_for_tests()  # as a new process: read back from the file
        assert autotune.pick("lut4_gemv", "m1_n64_k64", cands, cands[0], run, cuda) == {"BLOCK_N": 32}
        assert timed == [16, 32, 64] and compiled == [16, 32, 64]  # never compiled or timed again
    finally:
        autotune.reset_cache_for_tests()
