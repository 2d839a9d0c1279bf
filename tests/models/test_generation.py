"""CompiledGenerator: a static KV cache and torch.compile'd (fullgraph) prefill/decode steps give the
tokens of transformers' own greedy generate, compile once (no recompilation per token or per prompt
length), and run the torch_lowbit int8 CPU kernels inside the compiled graph; sampling and streamers;
torch_lowbit.generate's fast route and its fallback to model.generate."""
import copy

import pytest
import torch

import torch_lowbit as tl
from conftest import quantized_tiny_llama, tiny_llama


@pytest.fixture(scope="module")
def quantized_tiny():
    return quantized_tiny_llama("q4_0", seed=1234)


@pytest.fixture(scope="module", autouse=True)
def _compile_cache_home(tmp_path_factory):
    """Compiled steps (and the compile cache's signing key) go to a temporary folder, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_LOWBIT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def compiled(quantized_tiny):
    torch._dynamo.reset()
    gen = tl.CompiledGenerator(quantized_tiny, max_cache_len=48, native=False)
    gen.generate(torch.randint(0, 256, (1, 5)), 3)  # compiles prefill and decode once (and saves them)
    return gen


@pytest.fixture(scope="module")
def compiled_without_cache(quantized_tiny):
    """Plain torch.compile (fullgraph) steps, traced by Dynamo in this process."""
    torch._dynamo.reset()
    gen = tl.CompiledGenerator(quantized_tiny, max_cache_len=48, compile_cache=False, native=False)
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
    assert [s.fallback_calls for s in compiled.compiled_steps.values()] == ([0] * 4 if generator == "compiled" else [])


def test_compiled_sampling_compiles_its_own_graphs_once_and_leaves_the_greedy_ones(quantized_tiny, compiled):
    ids = _ids(quantized_tiny, 1, 6, 31)
    greedy = compiled.generate(ids, 8)
    first = compiled.generate(ids, 8, do_sample=True, top_k=1, seed=0)  # compiles the logits graphs
    with torch._dynamo.config.patch(error_on_recompile=True):  # nothing recompiles per token or length
        assert torch.equal(compiled.generate(ids, 8), greedy)
        sampled = compiled.generate(_ids(quantized_tiny, 1, 9, 32), 8, do_sample=True, temperature=0.8, seed=1)
    assert torch.equal(first, greedy) and sampled.shape == (1, 17)


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


class _Recorder:
    """A streamer (transformers' put/end protocol) that keeps what it was handed."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


def _ids(model, batch, n, seed):
    return torch.randint(0, model.config.vocab_size, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_sampling_with_a_seed_is_reproducible_and_top_k_1_is_greedy(quantized_tiny):
    gen = tl.CompiledGenerator(quantized_tiny, max_cache_len=32, compile=False)
    ids = _ids(quantized_tiny, 2, 5, 21)
    a = gen.generate(ids, 10, do_sample=True, temperature=1.5, top_p=0.95, seed=7)
    b = gen.generate(ids, 10, do_sample=True, temperature=1.5, top_p=0.95, generator=torch.Generator().manual_seed(7))
    c = gen.generate(ids, 10, do_sample=True, temperature=1.5, top_p=0.95, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)  # 20 draws at temperature 1.5: never all equal by chance
    assert torch.equal(gen.generate(ids, 10, do_sample=True, top_k=1, seed=1), gen.generate(ids, 10))


def test_sampler_keeps_only_the_top_k_and_top_p_tokens():
    from torch_lowbit.sampling import Sampler
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, 2.9]]).expand(400, -1)
    drawn = set(Sampler.build("cpu", top_k=2, seed=0)(logits).flatten().tolist())
    assert drawn == {0, 1}
    # softmax of (4, 3, 2.9, 0, -1): 0.56, 0.21, 0.19, ...: top_p 0.7 keeps the first two
    assert set(Sampler.build("cpu", top_k=0, top_p=0.7, seed=0)(logits).flatten().tolist()) == {0, 1}
    assert set(Sampler.build("cpu", top_k=0, seed=0)(logits).flatten().tolist()) >= {0, 1, 4}


def test_streamer_gets_the_prompt_then_every_token_in_order_as_transformers_hands_them(quantized_tiny):
    ids = _ids(quantized_tiny, 1, 6, 5)
    ours, theirs = _Recorder(), _Recorder()
    out = tl.CompiledGenerator(quantized_tiny, max_cache_len=32, compile=False).generate(ids, 7, streamer=ours)
    quantized_tiny.generate(ids, max_new_tokens=7, min_new_tokens=7, do_sample=False, streamer=theirs)
    assert ours.ended == 1 and len(ours.puts) == 1 + 7
    assert torch.equal(ours.puts[0], ids) and torch.equal(torch.cat(ours.puts[1:]), out[0, 6:])
    assert [p.shape for p in ours.puts] == [p.shape for p in theirs.puts]  # [1, prompt], then [batch] per token
    assert all(torch.equal(x, y) for x, y in zip(ours.puts, theirs.puts))


def test_text_streamer_prints_the_decoded_tokens(quantized_tiny, capsys):
    from transformers import TextStreamer

    class CharTokenizer:  # decode only: what TextStreamer calls
        def decode(self, ids, **kwargs):
            return "".join(chr(65 + int(i) % 26) for i in ids)
    ids = _ids(quantized_tiny, 1, 4, 9)
    out = tl.CompiledGenerator(quantized_tiny, max_cache_len=32, compile=False).generate(
        ids, 6, streamer=TextStreamer(CharTokenizer(), skip_prompt=True))
    assert capsys.readouterr().out.strip() == CharTokenizer().decode(out[0, 4:])


def test_sampling_and_streamer_arguments_are_checked(quantized_tiny):
    gen = tl.CompiledGenerator(quantized_tiny, max_cache_len=16, compile=False)
    ids = torch.zeros(1, 3, dtype=torch.long)
    cases = [(dict(do_sample=True, temperature=0.0), "temperature must be a finite number > 0"),
             (dict(do_sample=True, temperature=float("nan")), "temperature must be"),
             (dict(do_sample=True, top_p=0.0), r"top_p must be in \(0, 1\]"),
             (dict(do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\]"),
             (dict(do_sample=True, top_k=-1), "top_k must be an int >= 0"),
             (dict(do_sample=True, top_k=2.5), "top_k must be an int >= 0"),
             (dict(do_sample=True, seed=-3), "seed must be an int >= 0"),
             (dict(do_sample=True, seed=1, generator=torch.Generator()), "seed or generator, not both"),
             (dict(do_sample=True, generator=5), "generator must be a torch.Generator"),
             (dict(temperature=0.7), "pass do_sample=True"),
             (dict(streamer=object()), "streamer must have put"),
             (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            gen.generate(ids, **{"max_new_tokens": 2, **kwargs})
    with pytest.raises(ValueError, match="temperature must be"):
        tl.generate(quantized_tiny, ids, max_new_tokens=2, compile=False, do_sample=True, temperature=-1.0)
    with pytest.raises(ValueError, match="pass do_sample=True"):
        tl.generate(quantized_tiny, ids, max_new_tokens=2, compile=False, seed=3)
    with pytest.raises(TypeError, match="transformers causal LM"):
        tl.generate(torch.nn.Linear(2, 2), ids)


def test_generate_takes_the_fast_route_and_reuses_its_generator(quantized_tiny, caplog):
    ids = _ids(quantized_tiny, 2, 6, 13)
    with caplog.at_level("INFO", logger="torch_lowbit"):
        got, times = tl.generate(quantized_tiny, ids, max_new_tokens=9, compile=False, return_times=True)
        first = quantized_tiny._lowbit_generators.generators[(False, torch.device("cpu"))]
        again = tl.generate(quantized_tiny, ids, max_new_tokens=9, compile=False, do_sample=True, top_k=1)
    assert not caplog.records  # no fallback
    assert torch.equal(got, quantized_tiny.generate(ids, max_new_tokens=9, do_sample=False)) and torch.equal(again, got)
    assert times.new_tokens == got.shape[1] - 6 == len(times.per_token_s) + 1  # the compiled loop's own times
    assert quantized_tiny._lowbit_generators.generators[(False, torch.device("cpu"))] is first  # cached
    copied = copy.deepcopy(quantized_tiny)  # a copy starts without the original's generators (and graphs)
    assert not copied._lowbit_generators.generators
    assert torch.equal(tl.generate(copied, ids, max_new_tokens=9, compile=False), got)


@pytest.mark.parametrize("options, reason", [
    (dict(num_beams=2), "num_beams=2"),
    (dict(repetition_penalty=1.3), "repetition_penalty=1.3"),
    (dict(attention_mask=torch.tensor([[0, 1, 1, 1, 1]])), "attention_mask has zeros")])
def test_generate_falls_back_to_transformers_with_one_line_naming_why(options, reason, caplog):
    torch.manual_seed(17)
    model = tiny_llama()
    ids = _ids(model, 1, 5, 2)
    with caplog.at_level("INFO", logger="torch_lowbit"):
        got = tl.generate(model, ids, max_new_tokens=6, compile=False, **options)
        tl.generate(model, ids, max_new_tokens=6, compile=False, **options)  # the same reason: said once
    assert len(caplog.records) == 1 and reason in caplog.records[0].getMessage(), caplog.text
    assert "model.generate" in caplog.records[0].getMessage()
    assert torch.equal(got, model.generate(ids, max_new_tokens=6, **options))
    assert not getattr(model, "_lowbit_generators").generators  # no generator built


def test_generate_falls_back_for_an_architecture_without_a_one_graph_compile(caplog):
    """JetMoe marks itself _can_compile_fullgraph=False: compiled, the fast route refuses it."""
    from transformers import JetMoeConfig, JetMoeForCausalLM
    torch.manual_seed(3)
    model = JetMoeForCausalLM(JetMoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                           num_key_value_heads=2, kv_channels=16, intermediate_size=64,
                                           num_local_experts=2, num_experts_per_tok=1)).eval()
    ids = _ids(model, 1, 4, 1)
    with caplog.at_level("INFO", logger="torch_lowbit"):
        got, times = tl.generate(model, ids, max_new_tokens=5, return_times=True)
    assert len(caplog.records) == 1 and "JetMoeForCausalLM cannot be compiled in one graph" in caplog.text
    assert torch.equal(got, model.generate(ids, max_new_tokens=5, do_sample=False))
    assert times.new_tokens == got.shape[1] - 4 and times.prefill_s > 0  # timed through the streamer calls


def test_fallback_sampling_with_a_seed_is_reproducible():
    torch.manual_seed(8)
    model = tiny_llama()
    ids = _ids(model, 1, 4, 6)
    run = lambda seed: tl.generate(model, ids, max_new_tokens=8, compile=False, do_sample=True,  # noqa: E731
                                   repetition_penalty=1.1, seed=seed)
    assert torch.equal(run(4), run(4)) and not torch.equal(run(4), run(5))


@pytest.mark.skipif(not tl.ops.has_cpu_extension(), reason="the pool is the C++ extension's")
def test_decode_steps_run_torch_on_one_thread_and_the_kernels_on_the_pool(quantized_tiny):
    """A streamer sees the settings at each put: the prompt and the prefill's token as the user left them,
    every decoded token with torch on one thread and the kernels on the pool; restored afterwards."""
    class Settings:
        seen = []

        def put(self, _):
            self.seen.append(tl.threading_info())

        def end(self):
            pass

    before, torch_threads = tl.threading_info(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        streamer = Settings()
        tl.CompiledGenerator(quantized_tiny, max_cache_len=32, compile=False).generate(
            _ids(quantized_tiny, 1, 5, 9), 4, streamer=streamer)
        assert streamer.seen[:2] == [tl.threading_info()] * 2 and tl.threading_info()["torch_threads"] == 2
        assert streamer.seen[2:] == [{"scheduler": "pool", "threads": 2, "torch_threads": 1}] * 3
    finally:
        torch.set_num_threads(torch_threads)
    assert tl.threading_info() == before
