"""Compile once (torch_lowbit/compile_cache.py): a generator in a fresh process loads the steps the
first one compiled and gives the same tokens; a corrupt artifact is rebuilt with a log line; the key
follows the format and the shapes, not the weights."""
import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import torch_lowbit as tl
from conftest import quantized_tiny_llama
from torch_lowbit import compile_cache

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _own_cache_home(tmp_path, monkeypatch):
    """The signing key lives in the default cache folder: a temporary one, not the user's."""
    monkeypatch.setenv("TORCH_LOWBIT_CACHE", str(tmp_path / "home"))

# Run in a fresh interpreter: builds the tiny model (seeded), generates, prints the tokens and where
# each step's compiled code came from.
_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch, torch_lowbit as tl
    from conftest import quantized_tiny_llama
    model = quantized_tiny_llama("q4_0", seed=0)
    gen = tl.CompiledGenerator(model, max_cache_len=32, compile_cache_dir={folder!r}, native=False)
    out = gen.generate(torch.arange(3, 9).unsqueeze(0), 5)
    print(json.dumps({{"tokens": out.tolist(), **{{kind: [str(s.loaded_from), str(s.saved_to), s.fallback_calls]
                                                   for kind, s in gen.compiled_steps.items()}}}}))
""")


def _run_child(folder: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # TORCH_LOWBIT_CACHE: the test's (_own_cache_home)
    run = subprocess.run([sys.executable, "-c", _CHILD.format(tests=str(ROOT / "tests"), folder=str(folder))],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_fresh_process_loads_the_compiled_steps_and_gives_the_same_tokens(tmp_path):
    folder = tmp_path / "compiled"
    cold = _run_child(folder)
    assert cold["prefill"][0] == cold["decode"][0] == "None"  # compiled, saved
    assert Path(cold["prefill"][1]).exists() and Path(cold["decode"][1]).exists()
    warm = _run_child(folder)
    assert warm["prefill"][:2] == [cold["prefill"][1], "None"] and warm["decode"][:2] == [cold["decode"][1], "None"]
    assert warm["tokens"] == cold["tokens"]
    assert cold["prefill"][2] == cold["decode"][2] == warm["prefill"][2] == warm["decode"][2] == 0  # guards held
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    # the same tokens as transformers' own greedy generate
    model = quantized_tiny_llama("q4_0", seed=0)
    want = model.generate(torch.arange(3, 9).unsqueeze(0), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert warm["tokens"] == want.tolist()


@pytest.fixture(scope="module")
def quantized_tiny():
    return quantized_tiny_llama("q4_0", seed=99)


def test_a_corrupt_artifact_is_rebuilt_with_a_log_line(quantized_tiny, tmp_path, caplog):
    ids = torch.randint(0, quantized_tiny.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
    first = tl.CompiledGenerator(quantized_tiny, max_cache_len=16, compile_cache_dir=tmp_path, native=False)
    want = first.generate(ids, 3)
    path = first.compiled_steps["decode"].saved_to
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one flipped bit in the payload
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="torch_lowbit.compile_cache"):
        again = tl.CompiledGenerator(quantized_tiny, max_cache_len=16, compile_cache_dir=tmp_path, native=False)
        assert torch.equal(again.generate(ids, 3), want)
    steps = again.compiled_steps
    assert steps["prefill"].loaded_from == first.compiled_steps["prefill"].saved_to  # intact: loaded
    assert steps["decode"].loaded_from is None and steps["decode"].saved_to == path  # corrupt: rebuilt
    assert [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()] == \
        [f"torch_lowbit compile cache: rebuilding {path} (signature mismatch (corrupt, or not written by this cache))"]
    # the rebuilt artifact serves a model of other weights (they are graph inputs, not constants)
    other = quantized_tiny_llama("q4_0", seed=7)
    third = tl.CompiledGenerator(other, max_cache_len=16, compile_cache_dir=tmp_path, native=False)
    got = third.generate(ids, 3)
    assert third.compiled_steps["decode"].loaded_from == path and third.compiled_steps["prefill"].loaded_from
    assert torch.equal(got, other.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False))
    assert not torch.equal(got, want)


def test_the_key_follows_formats_and_shapes_not_weights():
    def key(model, batch=1, cache_len=16, kind="decode"):
        gen = tl.CompiledGenerator(model, max_cache_len=cache_len, compile_cache=False, native=False)
        cache = gen._fresh_cache(batch, torch.device("cpu"))
        ids = torch.zeros(batch, 1, dtype=torch.long)
        args = (model, ids, torch.tensor([0]), cache)
        return compile_cache.key_digest(compile_cache.step_key(tl.generation.greedy_step, args, dynamic=kind == "prefill"))

    base = key(quantized_tiny_llama("q4_0"))
    assert key(quantized_tiny_llama("q4_0", seed=1)) == base  # other weights: same compiled code (weights are inputs)
    assert key(quantized_tiny_llama("q8_0")) != base  # another format
    assert key(quantized_tiny_llama("q4_0"), batch=2) != base  # another batch
    assert key(quantized_tiny_llama("q4_0"), cache_len=32) != base  # another cache length
    assert key(quantized_tiny_llama("q4_0"), kind="prefill") != base
    with torch.no_grad():
        assert key(quantized_tiny_llama("q4_0")) != base  # grad mode is part of it too
    with pytest.MonkeyPatch.context() as mp:
        # another cap on the kernel paths than the run's own (CI may already cap at avx2)
        mp.setenv("TORCH_LOWBIT_CPU_MAX_PATH", "scalar" if os.environ.get("TORCH_LOWBIT_CPU_MAX_PATH") else "avx2")
        assert key(quantized_tiny_llama("q4_0")) != base


def test_an_artifact_from_another_key_or_user_is_never_unpickled(tmp_path, monkeypatch):
    path = tmp_path / "step.bin"
    path.write_bytes(compile_cache.MAGIC + b'{"key": {}, "sources": []}\n' + b"\0" * 32 + b"not a pickle")
    with pytest.raises(compile_cache.StaleArtifact, match="signature mismatch"):
        compile_cache.load_artifact(path, compile_cache._signing_key(), {})
    path.write_bytes(b"\x80\x04junk")
    with pytest.raises(compile_cache.StaleArtifact, match="not a torch_lowbit artifact"):
        compile_cache.load_artifact(path, compile_cache._signing_key(), {})


def test_an_artifact_traced_from_changed_sources_is_stale():
    from torch._dynamo.package import _hash_sourcelines
    from torch_lowbit import generation
    first = generation.greedy_step.__code__.co_firstlineno
    current = _hash_sourcelines(generation, first, first + 5)
    compile_cache._check_sources([["torch_lowbit.generation", first, first + 5, current]])  # unchanged: fine
    with pytest.raises(compile_cache.StaleArtifact, match="changed"):
        compile_cache._check_sources([["torch_lowbit.generation", first, first + 5, "0" * 64]])


def test_a_folder_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match="chmod 700"):
        compile_cache.open_directory(shared)


def test_compile_cache_needs_compile_without_cuda_graphs(quantized_tiny):
    with pytest.raises(ValueError, match="needs compile=True"):
        tl.CompiledGenerator(quantized_tiny, compile=False, compile_cache=True)
    assert tl.CompiledGenerator(quantized_tiny, compile=False).compiled_steps == {}
