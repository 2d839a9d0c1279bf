"""`bench cpu` across ISA paths (--path), the machine line every benchmark prints, the vs-q4_0 column,
and the SmolLM2 prefill / decode tables (on a tiny Llama; the real model only in the slow test)."""
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import torch_lowbit as tl
from torch_lowbit.ops import cpu_extension, cpu_model

PATHS = list(cpu_extension().available_cpu_paths())
TWO_PATHS = pytest.mark.skipif(len(PATHS) < 2, reason="this CPU runs only the scalar path")


def _bench(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "torch_lowbit", "bench", *argv], capture_output=True, text=True,
                          timeout=timeout)


def _table_rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| 64x128 |")]


@TWO_PATHS
def test_bench_cpu_times_each_kernel_on_each_path_and_names_the_cpu():
    best, other = PATHS[0], PATHS[-1]  # e.g. avx512 and scalar
    r = _bench("cpu", "--path", best, other, "--formats", "q4_0", "int4_g128", "--shapes", "64x128", "--m", "1",
               "--threads", "1", "--rotate-mib", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    first = r.stdout.splitlines()[0]
    assert f"CPU: {cpu_model()}" in first and f"ISA path: {cpu_extension().get_cpu_path()}" in first
    assert "date: 20" in first and "torch_lowbit" in first
    rows = _table_rows(r.stdout)
    header = next(line for line in r.stdout.splitlines() if line.startswith("| W (N x K)"))
    assert "| path |" in header and header.endswith("| vs aten int4 g32 | vs q4_0 |")
    for fmt in ("q4_0", "int4_g128"):
        ours = [row for row in rows if row[3].startswith(f"torch_lowbit {fmt} [")]
        assert [row[4] for row in ours] == [best, other]  # side by side, in the order asked
        for row in ours:
            assert row[3].endswith(f"] {row[4]}") and float(row[5]) >= 0 and row[9].endswith("x")
            if fmt == "q4_0":
                assert row[10] == "1.00x"  # against itself: the same-path q4_0 row
    torch_rows = [row for row in rows if not row[3].startswith("torch_lowbit")]
    assert [row[3] for row in torch_rows] == ["torch fp32 F.linear", "torch bf16 F.linear",
                                              "aten int4pack g32 (bf16)", "aten int4pack g128 (bf16)"]  # once each
    assert all(row[4] == "-" for row in torch_rows) and len(rows) == 4 + 2 * 2


def test_bench_cpu_rejects_a_path_this_cpu_cannot_run_before_any_work():
    missing = [p for p in ("avx512", "avxvnni", "avx2") if p not in PATHS]
    for bad in ["avx9", *missing[:1]]:
        r = _bench("cpu", "--path", "scalar", bad, "--shapes", "64x128")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-1000:]
        assert f"--path {bad}: not a kernel path this CPU" in r.stderr and " ".join(PATHS) in r.stderr
        assert "DRAM" not in r.stdout
    r = _bench("e2e", "--path", "scalar")
    assert r.returncode == 2 and "--path goes with bench cpu" in r.stderr


def test_bench_cpu_runs_under_each_path_and_puts_the_previous_one_back():
    from torch_lowbit.bench import cpu
    c = cpu_extension()
    seen = []

    class Spy(torch.nn.Module):  # records the path in force whenever the bench calls it
        def forward(self, x):
            seen.append(c.get_cpu_path())
            return x

    def contenders(n, k, formats, rotate_mib, layouts):
        return {"torch_lowbit q4_0 [lut4_i8_n16, int8 act]": (lambda i: Spy(), 1, torch.float32, 1, "q4_0",
                                                              "lut4_i8_n16")}

    mp = pytest.MonkeyPatch()
    mp.setattr(cpu, "_contenders", contenders)
    mp.setattr(cpu, "dram_read_gbs", lambda mib: 1.0)
    mp.setattr(cpu, "_median_us", lambda fn, copies: (fn(0), 1.0)[1])
    try:
        with tl.use_backend("cpu", path="scalar"):
            rows, _ = cpu.bench_cpu(shapes=((16, 32),), ms=(1,), threads=(1,), paths=PATHS, progress=lambda m: None)
            assert c.get_cpu_path() == "scalar"
            assert seen == PATHS and [r.path for r in rows] == PATHS
            rows, _ = cpu.bench_cpu(shapes=((16, 32),), ms=(1,), threads=(1,), progress=lambda m: None)
            assert [r.path for r in rows] == ["scalar"]  # default: the path in force
        with pytest.raises(ValueError, match="cannot run here"):
            cpu.bench_cpu(shapes=((16, 32),), ms=(1,), threads=(1,), paths=["scalar", "neon"])
    finally:
        mp.undo()


def test_use_backend_puts_back_the_outer_path():
    c = cpu_extension()
    before = c.get_cpu_path()  # the best path, or TORCH_LOWBIT_CPU_PATH's
    with tl.use_backend("cpu", path=PATHS[-1]):
        with tl.use_backend("cpu", path=PATHS[0]):
            assert c.get_cpu_path() == PATHS[0]
        assert c.get_cpu_path() == PATHS[-1]
    assert c.get_cpu_path() == before


def test_vs_q4_0_compares_with_q4_0_on_the_same_path_and_layout():
    from torch_lowbit.bench.cpu import Row, format_table

    def row(name, us, path="-", fmt="", layout=""):
        return Row("64x128", 1, 1, name, us, 1000, path, fmt, layout)

    rows = [row("aten int4pack g32 (bf16)", 40.0),
            row("q4_0 i8 avx2", 10.0, "avx2", "q4_0", "lut4_i8_n16"),
            row("q4_0 rm avx2", 20.0, "avx2", "q4_0", "lut4_rowmajor"),
            row("q4_0 i8 scalar", 80.0, "scalar", "q4_0", "lut4_i8_n16"),
            row("int4_g128 rm avx2", 25.0, "avx2", "int4_g128", "lut4_rowmajor"),
            row("int4_g128 rm scalar", 40.0, "scalar", "int4_g128", "lut4_rowmajor"),
            row("nuq3 any", 5.0, "any", "nuq3", "palette_packed")]
    table = format_table(rows, 10.0, "CPU: test").splitlines()
    assert table[0] == "CPU: test"
    ratios = {line.split("|")[4].strip(): (line.split("|")[-3].strip(), line.split("|")[-2].strip())
              for line in table if line.startswith("| 64x128")}
    assert ratios["aten int4pack g32 (bf16)"] == ("1.00x", "0.25x")  # against the first q4_0 row
    assert ratios["q4_0 i8 scalar"] == ("0.50x", "1.00x")
    assert ratios["int4_g128 rm avx2"] == ("1.60x", "0.80x")  # q4_0 in its layout on its path: 20 us
    assert ratios["int4_g128 rm scalar"] == ("1.00x", "2.00x")  # no scalar q4_0 rowmajor: scalar q4_0 i8
    assert ratios["nuq3 any"][1] == "2.00x"
    no_q4_0 = format_table([r for r in rows if r.fmt != "q4_0"], 10.0)
    assert "vs q4_0" not in no_q4_0 and no_q4_0.startswith("DRAM read bandwidth")


@pytest.fixture
def tiny_smollm2(monkeypatch):
    """SmolLM2 swapped for the tiny Llama, with a tokenizer giving 40 random ids."""
    from conftest import tiny_llama

    import torch_lowbit.eval as tl_eval
    tiny = tiny_llama()
    gen = torch.Generator().manual_seed(0)

    class Tokenizer:
        eos_token_id = 0

        def __call__(self, text, return_tensors):
            return SimpleNamespace(input_ids=torch.randint(1, tiny.config.vocab_size, (1, 40), generator=gen))

    monkeypatch.setattr(tl_eval, "load_smollm2", lambda: (tiny, Tokenizer()))
    return tiny


def test_bench_prefill_rows_per_thread_count_format_and_path(tiny_smollm2):
    from torch_lowbit.bench.cpu import bench_prefill
    paths = PATHS[:1] + PATHS[-1:] if len(PATHS) > 1 else PATHS
    threads = torch.get_num_threads()
    rows = bench_prefill(("q4_0",), threads=(1, 2), prompt_tokens=24, repeats=1, paths=paths,
                         progress=lambda m: None)
    assert torch.get_num_threads() == threads
    assert [r[:3] for r in rows] == [[t, m, p] for t in ("1", "2") for m, p in [("fp32", "-")] +
                                     [("q4_0", p) for p in paths]]
    assert all(r[-1] == "1.00x" for r in rows if r[1] == "fp32")
    assert all(float(r[4]) >= 0 for r in rows) and float(rows[1][3]) < float(rows[0][3])  # q4_0 smaller
    with pytest.raises(ValueError, match="fewer prompt tokens"):
        bench_prefill(("q4_0",), threads=(1,), prompt_tokens=64, progress=lambda m: None)


def test_prefill_tokens_per_s_times_one_forward_over_the_prompt(tiny_smollm2):
    from torch_lowbit.eval.speed import prefill_tokens_per_s
    calls = []
    tiny_smollm2.register_forward_hook(lambda mod, args, kwargs, out: calls.append((kwargs["input_ids"].shape,
                                                                                    out.logits.shape)),
                                       with_kwargs=True)
    ids = torch.randint(0, 256, (1, 17))
    assert prefill_tokens_per_s(tiny_smollm2, ids, repeats=3) > 0
    assert calls == [((1, 17), (1, 1, 256))] * 4  # warm-up + 3, last position's logits only


def test_bench_decode_rows_name_the_path(tiny_smollm2):
    from torch_lowbit.bench.cpu import bench_decode
    rows = bench_decode(("q4_0",), new_tokens=3, paths=PATHS[-1:], progress=lambda m: None)
    assert [r[:2] for r in rows] == [["fp32", "-"], ["bf16", "-"], ["q4_0", PATHS[-1]],
                                     ["q4_0 +lm_head", PATHS[-1]]]
    assert rows[0][-1] == "1.00x"


@pytest.mark.slow
def test_cli_bench_cpu_prefill_on_smollm2():
    r = _bench("cpu", "--prefill", "--formats", "q4_0", "--shapes", "64x128", "--m", "1", "--threads", "1",
               "--rotate-mib", "1", "--repeats", "1", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.split("SmolLM2-135M prefill")[1]
    assert "128-token Wikipedia prompt" in out and cpu_model() in out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| 1 |")]
    assert [r[1:3] for r in rows] == [["fp32", "-"], ["q4_0", cpu_extension().get_cpu_path()]]
    assert rows[0][-1] == "1.00x" and float(rows[1][4]) >= 0


def test_bench_kv_rows_compare_each_cache_with_fp32():
    from torch_lowbit.bench.kv import KV_HEADERS, bench_kv
    rows = bench_kv(tokens=64, threads=(1,), bits=(4,), rotate_mib=1, shapes=("smollm2-135m",), vq=("cq2",))
    assert [r[3] for r in rows] == ["fp32 cache, gqa_attention", "int4 cache, kv_attention",
                                    "int4 cache, dequantize + gqa_attention", "cq2 cache, kv_vq_attention"]
    assert all(len(r) == len(KV_HEADERS) for r in rows)
    assert float(rows[1][-1].rstrip("x")) < 0.3  # memory vs the fp32 baseline
    # the CQ row counts its codebooks too: at 64 tokens they outweigh the fp32 cache
    assert float(rows[3][-1].rstrip("x")) > 1


def test_bench_cpu_times_per_token_activation_variants():
    from torch_lowbit.bench.cpu import bench_cpu, split_act_suffix
    assert split_act_suffix("q4_0+a8") == ("q4_0", 8, 0) and split_act_suffix("int4_g64") == ("int4_g64", 0, 0)
    assert split_act_suffix("q4_0+a4b16") == ("q4_0", 4, 16)
    rows, _ = bench_cpu(shapes=((48, 64),), ms=(3,), threads=(1,), formats=("q4_0", "q4_0+a4", "q4_0+a4b16"),
                        rotate_mib=1, progress=lambda msg: None)
    names = [r.name for r in rows]
    assert any("q4_0+a4" in n and "int4 per-token act" in n for n in names) and all(r.us >= 0 for r in rows)
    assert any("q4_0+a4b16" in n and "int4 act, blocks of 16" in n for n in names)


def test_e2e_cuda_models_and_errors(monkeypatch):
    """bench e2e --device cuda: the 1B-shaped model has Llama-3.2-1B's shapes (built on the meta device
    here), an unknown model name and a machine without CUDA are errors naming the fix."""
    from torch_lowbit.bench import e2e_cuda
    model = e2e_cuda.llama_1b_shaped(device="meta")
    layer = model.model.layers[0]
    assert (layer.self_attn.q_proj.weight.shape, layer.self_attn.k_proj.weight.shape,
            layer.mlp.gate_proj.weight.shape) == ((2048, 2048), (512, 2048), (8192, 2048))
    assert len(model.model.layers) == 16 and model.lm_head.weight is model.model.embed_tokens.weight
    assert 1.2e9 < sum(p.numel() for p in model.parameters()) < 1.3e9 and model.dtype == torch.float16
    with pytest.raises(ValueError, match="unknown model 'llama-8b'"):
        e2e_cuda._base("llama-8b", "meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        e2e_cuda.bench_e2e_cuda()


def test_bench_cpu_rounds_interleave_contenders_and_take_medians(monkeypatch):
    """rounds: A B, A B, A B — each row the median of its rounds."""
    from torch_lowbit.bench import cpu
    order, times = [], iter([5.0, 50.0, 1.0, 70.0, 3.0, 60.0])

    def contenders(n, k, formats, rotate_mib, layouts):
        return {name: (lambda i, name=name: (lambda x: order.append(name)), 1, torch.float32, 1, "", "")
                for name in ("A", "B")}

    monkeypatch.setattr(cpu, "_contenders", contenders)
    monkeypatch.setattr(cpu, "dram_read_gbs", lambda mib: 1.0)
    monkeypatch.setattr(cpu, "_median_us", lambda fn, copies: (fn(0), next(times))[1])
    rows, _ = cpu.bench_cpu(shapes=((16, 32),), ms=(1,), threads=(1,), progress=lambda m: None, rounds=3)
    assert order == ["A", "B"] * 3
    assert [(r.name, r.us) for r in rows] == [("A", 3.0), ("B", 60.0)]
