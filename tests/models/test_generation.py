"""CompiledGenerator: a static KV cache and torch.compile'd (fullgraph) prefill/decode steps give the
tokens of transformers' own greedy generate, compile once (no recompilation per token or per prompt
length), and run the torch_lowbit int8 CPU kernels inside the compiled graph."""
import pytest
import torch

import torch_lowbit as tl
from conftest import tiny_llama


@pytest.fixture(scope="module")
def quantized_tiny():
    torch.manual_seed(1234)
    model = tiny_llama()
    tl.quantize_(model, "q4_0", progress=False)
    return model


@pytest.fixture(scope="module", autouse=True)
def _compile_cache_home(tmp_path_factory):
    """Compiled steps (and the compile cache's signing key) go to a temporary folder, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_LOWBIT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def compiled(quantized_tiny):
    torch._dynamo.reset()
    gen = tl.CompiledGenerator(quantized_tiny, max_cache_len=48)
    gen.generate(torch.randint(0, 256, (1, 5)), 3)  # compiles prefill and decode once (and saves them)
    return gen


@pytest.fixture(scope="module")
def compiled_without_cache(quantized_tiny):
    """Plain torch.compile (fullgraph) steps, traced by Dynamo in this process."""
    torch._dynamo.reset()
    gen = tl.CompiledGenerator(quantized_tiny, max_cache_len=48, compile_cache=False)
    gen.generate(torch.randint(0, 256, (1, 5)), 3)
    return gen


def _hf_greedy(model, ids, n):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("prompt_len", [1, 6, 13])
@pytest.mark.parametrize("generator", ["compiled", "compiled_without_cache"])
def test_compiled_generation_equals_transformers_greedy_without_recompiling(quantized_tiny, generator, prompt_len,
                                                                            request):
    compiled = request.getfixturevalue(generator)
    gen = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(0, quantized_tiny.config.vocab_size, (1, prompt_len), generator=gen)
    want = _hf_greedy(quantized_tiny, ids, 9)
    with torch._dynamo.config.patch(error_on_recompile=True):  # every length reuses the first graphs
        got = compiled.generate(ids, 9)
    assert torch.equal(got, want)
    assert compiled.times.new_tokens == 9 and len(compiled.times.per_token_s) == 8
    # with the compile cache: every call passed the saved steps' guards (none fell back to a new compile)
    assert [s.fallback_calls for s in compiled.compiled_steps.values()] == ([0, 0] if generator == "compiled" else [])


def test_eager_generation_equals_transformers_greedy(quantized_tiny):
    ids = torch.randint(0, quantized_tiny.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(7))
    got = tl.CompiledGenerator(quantized_tiny, max_cache_len=32, compile=False).generate(ids, 6)
    assert torch.equal(got, _hf_greedy(quantized_tiny, ids, 6))


def test_int8_kernels_run_inside_the_compiled_decode_step(quantized_tiny, compiled):
    ids = torch.randint(0, quantized_tiny.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled.generate(ids, 3)
    names = {e.name for e in prof.events()}
    assert "torch_lowbit::lut_i8_linear" in names, sorted(n for n in names if "lowbit" in n)
    assert "torch_lowbit::gqa_attention" in names, sorted(n for n in names if "lowbit" in n)  # decode attention
    # inductor's graph ran (a compiled region traced here, or the precompiled steps' FX graph call)
    assert any("Torch-Compiled Region" in n or "CompiledFunction" in n or "Call CompiledFxGraph" in n
               for n in names), "ran eagerly"


def test_attention_implementation_is_restored(quantized_tiny):
    before = quantized_tiny.config._attn_implementation
    gen = tl.CompiledGenerator(quantized_tiny, max_cache_len=16, compile=False, attn_implementation="eager")
    seen = []
    hook = quantized_tiny.register_forward_pre_hook(lambda m, a: seen.append(m.config._attn_implementation))
    try:
        gen.generate(torch.zeros(1, 3, dtype=torch.long), 2)
    finally:
        hook.remove()
    assert seen and set(seen) == {"eager"} and quantized_tiny.config._attn_implementation == before


def test_eos_stops_every_row(quantized_tiny):
    ids = torch.randint(0, quantized_tiny.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(11))
    free = tl.CompiledGenerator(quantized_tiny, max_cache_len=32, compile=False).generate(ids, 8)
    eos = int(free[0, 7])  # the third new token
    stopped = tl.CompiledGenerator(quantized_tiny, max_cache_len=32, compile=False).generate(ids, 8, eos_token_id=eos)
    assert torch.equal(stopped, free[:, :8])


def test_bad_input_is_rejected_with_the_fix(quantized_tiny):
    gen = tl.CompiledGenerator(quantized_tiny, max_cache_len=16, compile=False)
    with pytest.raises(ValueError, match="max_cache_len"):
        gen.generate(torch.zeros(1, 10, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="LongTensor"):
        gen.generate(torch.zeros(1, 4), 2)
    with pytest.raises(TypeError, match="causal LM"):
        tl.CompiledGenerator(torch.nn.Linear(2, 2))


def test_bench_e2e_rows_on_a_tiny_model(monkeypatch):
    """The e2e table's rows and ratios (SmolLM2 swapped for the tiny Llama; llama.cpp left out)."""
    from types import SimpleNamespace

    from torch_lowbit.bench import e2e
    torch.manual_seed(5)
    tiny = tiny_llama()
    tokenizer = lambda text, return_tensors: SimpleNamespace(  # noqa: E731
        input_ids=torch.randint(0, tiny.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0)))
    monkeypatch.setattr(e2e, "load_smollm2", lambda: (tiny, tokenizer))
    rows, facts = e2e.bench_e2e(("fp32", "q4_0", "q4_0@kv4"), prompt_tokens=24, new_tokens=5, threads=1, repeats=1,
                                modes=("eager",), peers=False, progress=lambda msg: None)
    assert [r[:2] for r in rows] == [["fp32", "eager"], ["q4_0", "eager"], ["q4_0, 4-bit KV cache", "eager"]]
    assert rows[0][-1] == "1.00x" and rows[0][-2] == "-"
    assert float(rows[1][2]) < float(rows[0][2])  # the q4_0 model is smaller
    assert all(float(r[3]) >= 0 and float(r[4]) >= 0 for r in rows)  # timed: any value
    assert facts["llama.cpp"] == "not asked"
    with pytest.raises(ValueError, match="@kv4 or @kv8"):
        e2e.variant_formats("q4_0@kv3")
    with pytest.raises(ValueError, match="fewer prompt tokens"):
        e2e.bench_e2e(("fp32",), prompt_tokens=64, modes=("eager",), peers=False, progress=lambda msg: None)


def test_cuda_graph_decode_loop_gives_the_same_tokens(quantized_tiny):
    """cuda_graphs=True: the decode step compiled with mode="reduce-overhead", each replay marked as a
    new step and its token copied out of the graph's buffer. On CPU tensors inductor records no graph,
    so this runs the loop's bookkeeping (a one-token prompt takes the decode path first); the CUDA
    replay itself is the -m gpu test below."""
    assert not tl.CompiledGenerator(quantized_tiny, max_cache_len=16).cuda_graphs  # off CPU only by default
    with pytest.raises(ValueError, match="needs compile=True"):
        tl.CompiledGenerator(quantized_tiny, max_cache_len=16, compile=False, cuda_graphs=True)
    gen = tl.CompiledGenerator(quantized_tiny, max_cache_len=32, cuda_graphs=True)
    for prompt_len in (1, 5):
        ids = torch.randint(0, quantized_tiny.config.vocab_size, (1, prompt_len),
                            generator=torch.Generator().manual_seed(prompt_len))
        assert torch.equal(gen.generate(ids, 6), _hf_greedy(quantized_tiny, ids, 6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_decodes_from_a_cuda_graph_with_the_same_tokens():
    torch.manual_seed(4321)
    model = tiny_llama().cuda().half()
    tl.quantize_(model, "q4_0", progress=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 7), device="cuda")
    want = tl.CompiledGenerator(model, max_cache_len=32, cuda_graphs=False).generate(ids, 12)  # same kernels
    gen = tl.CompiledGenerator(model, max_cache_len=32)
    assert gen.cuda_graphs
    gen.generate(ids, 12)  # warm-up and recording
    assert torch.equal(gen.generate(ids, 12), want)
