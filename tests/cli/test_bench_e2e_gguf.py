"""`bench e2e` on GGUF files (bench/e2e_gguf.py) and the random-weight files it writes (bench/gguf_recipe.py):
on a TINY variant of the Llama-3.2-1B recipe (2 layers, hidden 256), never the 1B files themselves."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from torch_lowbit.bench import e2e, e2e_gguf, gguf_recipe  # noqa: E402
from torch_lowbit.bench.gguf_recipe import GGUFRecipe, bench_gguf, q2_k_blocks  # noqa: E402
from torch_lowbit.bench.model_shapes import LLAMA_1B  # noqa: E402

TINY = dict(LLAMA_1B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private TORCH_LOWBIT_CACHE for this module (the files are written into it once)."""
    d = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCH_LOWBIT_CACHE", str(d))
    yield d
    mp.undo()


@pytest.fixture(scope="module")
def tiny_files(cache):
    return {kind: bench_gguf(GGUFRecipe(f"tiny-{kind.lower()}", TINY, kind)) for kind in ("Q4_0", "Q2_K")}


def test_recipe_file_has_the_recipe_shapes_types_and_smollm2_tokenizer(tiny_files):
    from torch_lowbit.eval.assets import smollm2_gguf
    smollm2 = gguf.GGUFReader(smollm2_gguf())
    for kind, path in tiny_files.items():
        reader = gguf.GGUFReader(path)
        tensors = {t.name: t for t in reader.tensors}
        assert "output.weight" not in tensors  # the head is tied to token_embd
        assert len(tensors) == 2 * 9 + 2
        expect = {"attn_q": (256, 256), "attn_k": (256, 128), "attn_v": (256, 128), "attn_output": (256, 256),
                  "ffn_gate": (256, 512), "ffn_up": (256, 512), "ffn_down": (512, 256)}  # ggml order: [in, out]
        for layer in range(2):
            for name, shape in expect.items():
                t = tensors[f"blk.{layer}.{name}.weight"]
                assert (t.tensor_type.name, tuple(int(v) for v in t.shape)) == (kind, shape)
            assert tensors[f"blk.{layer}.attn_norm.weight"].tensor_type.name == "F32"
        embd = tensors["token_embd.weight"]
        assert (embd.tensor_type.name, tuple(int(v) for v in embd.shape)) == ("Q8_0", (256, 49152))
        assert [int(reader.fields[f"llama.{k}"].contents()) for k in
                ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                 "attention.head_count_kv", "vocab_size")] == [2, 256, 512, 4, 2, 49152]
        assert reader.fields["tokenizer.ggml.tokens"].contents() == smollm2.fields["tokenizer.ggml.tokens"].contents()
        w = gguf.quants.dequantize(tensors["blk.0.ffn_up.weight"].data, tensors["blk.0.ffn_up.weight"].tensor_type)
        assert 0.015 < float(np.std(w)) < 0.025  # N(0, 0.02), quantized


def test_from_gguf_loads_both_files(tiny_files):
    from torch_lowbit.io import from_gguf
    from torch_lowbit.nn import QuantEmbedding, QuantLinear
    for kind, requantize, fmt in (("Q4_0", None, "q4_0"), ("Q2_K", "int2_g64", "int2_g64")):
        model, _ = from_gguf(tiny_files[kind], requantize=requantize, tokenizer=False)
        linears = [m for m in model.model.layers.modules() if isinstance(m, QuantLinear)]
        assert linears and {m.fmt.name for m in linears} == {fmt}
        assert isinstance(model.model.embed_tokens, QuantEmbedding) and model.lm_head.fmt.name == "q8_0"
        assert model.config.tie_word_embeddings and model.config.num_hidden_layers == 2
        logits = model(torch.tensor([[1, 2, 3]])).logits
        assert logits.shape == (1, 3, 49152) and torch.isfinite(logits).all()


def test_q2_k_blocks_put_each_code_where_gguf_reads_it():
    """Weights on a Q2_K grid (4-bit scales and mins of fp16 d, dmin, every code 0..3 in each sub-block)
    come back exactly from gguf's own Q2_K dequantizer; random weights come back with 2-bit error."""
    gen = np.random.default_rng(0)
    rows, supers = 3, 2
    d, dmin = np.float16(0.01), np.float16(0.004)
    sc = gen.integers(1, 16, (rows * supers, 16))
    mn = gen.integers(0, 16, (rows * supers, 16))
    sc[:, 0], mn[:, 0] = 15, 15  # the super-block's largest step and min set d and dmin
    q = gen.integers(0, 4, (rows * supers, 16, 16))
    q[:, :, 0], q[:, :, 1] = 0, 3  # each sub-block spans its grid
    w = (np.float32(d) * sc[..., None] * q - np.float32(dmin) * mn[..., None]).astype(np.float32)
    w = w.reshape(rows, supers * 256)
    blocks = q2_k_blocks(w)
    assert blocks.shape == (rows, supers * 84) and blocks.dtype == np.uint8
    np.testing.assert_allclose(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q2_K), w, rtol=0, atol=1e-6)
    x = gen.standard_normal((4, 512)).astype(np.float32)
    err = gguf.quants.dequantize(q2_k_blocks(x), gguf.GGMLQuantizationType.Q2_K) - x
    assert float((err ** 2).mean() / (x ** 2).mean()) < 0.15
    with pytest.raises(ValueError, match="multiples of 256"):
        gguf_recipe.write_recipe(GGUFRecipe("bad", dict(TINY, intermediate_size=320), "Q2_K"), None)


def test_the_cache_is_reused_and_rewritten_when_the_recipe_changes(cache, monkeypatch):
    writes = []
    real = gguf_recipe.write_recipe

    def counting(recipe, path):
        writes.append(recipe)
        real(recipe, path)

    monkeypatch.setattr(gguf_recipe, "write_recipe", counting)
    small = dict(TINY, num_hidden_layers=1)
    first = bench_gguf(GGUFRecipe("cache-test", small, "Q4_0"))
    assert first.parent == cache / "bench" and first.name.startswith("cache-test-")
    stat = first.stat()
    assert bench_gguf(GGUFRecipe("cache-test", small, "Q4_0")) == first and len(writes) == 1
    assert first.stat().st_mtime_ns == stat.st_mtime_ns
    changed = bench_gguf(GGUFRecipe("cache-test", small, "Q4_0", std=0.03))
    assert changed != first and len(writes) == 2 and changed.is_file() and not first.exists()
    assert not [p for p in (cache / "bench").iterdir() if p.name.endswith(".tmp")]
    assert GGUFRecipe("x", small).key() != GGUFRecipe("x", small, seed=1).key()


def test_decode_read_bytes_ours_and_llama_cpp(tiny_files):
    """A decoded token reads every weight but the embedding table (one row of it): with a tied head
    the table is read in full by the head, on both sides."""
    from torch_lowbit.eval.speed import decode_read_nbytes, model_nbytes
    from torch_lowbit.io import from_gguf
    from torch_lowbit.io.gguf import open_gguf
    model, _ = from_gguf(tiny_files["Q4_0"], tokenizer=False)
    row = 256 // 32 * 34  # one Q8_0 row of the embedding
    assert decode_read_nbytes(model) == model_nbytes(model)["total"] + row
    reader = open_gguf(tiny_files["Q4_0"])
    assert e2e.gguf_decode_read_nbytes(reader) == sum(int(t.n_bytes) for t in reader.tensors)
    from conftest import tiny_llama
    untied = tiny_llama()  # fp32, its own head: the embedding table is not read
    emb = untied.model.embed_tokens.weight
    assert decode_read_nbytes(untied) == model_nbytes(untied)["total"] - emb.nbytes + emb.nbytes // emb.shape[0]


def test_import_plan_names_each_part_as_from_gguf_imports_it():
    types = e2e.GGUFTypes
    assert e2e_gguf.import_plan(types(["Q4_0"], "Q8_0", None)) == "GGUF import: q4_0 + q8_0 embedding/head"
    assert e2e_gguf.import_plan(types(["Q2_K", "Q6_K"], "Q5_0", None)) == \
        "GGUF import: q2_k + q6_k + q5_0 embedding/head"
    assert e2e_gguf.import_plan(types(["Q2_K"], "Q8_0", None), "int2_g64") == \
        "GGUF import: Q2_K requantized to int2_g64 + q8_0 embedding/head"
    assert e2e_gguf.import_plan(types(["Q2_K", "Q3_K", "Q4_0"], "Q6_K", "Q6_K"), "int2_g64") == \
        "GGUF import: q4_0 + Q2_K/Q3_K requantized to int2_g64 + q6_k embedding, q6_k head"
    assert e2e_gguf.import_plan(types(["F16", "IQ2_XS"], "F16", None)) == \
        "GGUF import: F16/IQ2_XS dequantized to fp32 + fp32 embedding/head"


def _bench(*argv, cache, timeout=180):
    env = dict(os.environ, TORCH_LOWBIT_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "torch_lowbit", "bench", "e2e", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_cli_bench_e2e_gguf_runs_end_to_end(tiny_files, cache):
    r = _bench("--gguf", str(tiny_files["Q4_0"]), "--quick", "--no-peers", "--repeats", "1", "--new-tokens", "3",
               "--prompt-tokens", "12", "--threads", "1", cache=cache)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("CPU: ") and "DRAM read " in lines[1] and "llama.cpp: not asked" in lines[1]
    assert f"{tiny_files['Q4_0']}: GGUF Q4_0, Q8_0 embedding/head:" in lines
    assert any(line.startswith("| model | mode | size MB | prefill tok/s | decode tok/s | weights read MB/token | "
                               "decode GB/s | prefill vs llama.cpp | decode vs llama.cpp |") for line in lines)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| GGUF import")]
    assert len(rows) == 1 and rows[0][:2] == ["GGUF import: q4_0 + q8_0 embedding/head", "eager"]
    read_mb, decode, gbs = float(rows[0][5]), float(rows[0][4]), float(rows[0][6])
    assert read_mb > 13 and decode > 0 and abs(gbs - read_mb * decode / 1e3) < 0.01 + 0.01 * gbs
    assert rows[0][-2:] == ["-", "-"]


def test_bad_gguf_inputs_are_one_line_errors_before_anything_is_timed(tmp_path, cache):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(64))
    cases = [(["--gguf", str(tmp_path / "missing.gguf")], "pass the path of a llama.cpp .gguf model file"),
             (["--gguf", str(corrupt)], "is not a readable GGUF file"),
             (["--gguf", str(corrupt), "--formats", "q4_0"], "--formats picks SmolLM2's rows; add --models smollm2")]
    for argv, message in cases:
        r = _bench(*argv, cache=cache, timeout=120)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr[-800:])
        assert r.stderr.strip().splitlines()[-1].count("error:") == 1 and "DRAM" not in r.stdout
    for arch, message in (("gpt2", "from_gguf supports the architectures"), ("llama", "has no tokenizer.* metadata")):
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(path, arch)
        writer.add_block_count(1)
        writer.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("*", r"\*")):
            e2e_gguf.check_bench_gguf(path)
    with pytest.raises(ValueError, match="unknown model 'llama-8b'"):
        next(e2e_gguf.e2e_sections(["llama-8b"]))


def test_perplexity_rows_are_eval_perplexity_of_the_import(tiny_files):
    import torch_lowbit as tl
    from torch_lowbit.eval.assets import wiki_text
    from torch_lowbit.eval.perplexity import perplexity
    path = tiny_files["Q4_0"]
    rows = e2e_gguf.perplexity_rows(path, tokens=300, ctx=100, threads=1, peers=False)
    model, tokenizer = tl.from_gguf(path)
    expected = perplexity(model, tokenizer, wiki_text(400), ctx=100, max_tokens=300, progress=False)
    assert rows == [["GGUF import: q4_0 + q8_0 embedding/head", f"{expected:.4f}", "-"]]


def test_llama_cpp_perplexity_matches_ours_on_the_same_file(tiny_files):
    pytest.importorskip("llama_cpp")  # the optional [peers] extra
    import torch_lowbit as tl
    from torch_lowbit.eval.assets import wiki_text
    from torch_lowbit.eval.perplexity import perplexity
    path = tiny_files["Q4_0"]
    model, tokenizer = tl.from_gguf(path)
    ids = tokenizer(wiki_text(400), return_tensors="pt").input_ids[0][:300]
    theirs = e2e.llama_cpp_perplexity(path, ids, 100, 1)
    ours = perplexity(model, tokenizer, wiki_text(400), ctx=100, max_tokens=300, progress=False)
    assert abs(theirs / ours - 1) < 0.01, (theirs, ours)  # the same blocks; int8-activation rounding apart


def test_ppl_without_a_gguf_file_is_a_clear_error(cache):
    r = _bench("--ppl", "--models", "llama-1b", cache=cache, timeout=120)
    assert r.returncode == 2 and "--ppl goes with bench e2e --gguf FILE" in r.stderr
