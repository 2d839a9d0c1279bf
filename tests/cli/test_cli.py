import os
import subprocess
import sys


def test_cli_lists_formats():
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "formats"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "q4_0" in r.stdout and "int4_g128" in r.stdout and "4.500" in r.stdout


def test_cli_rejects_unknown_format():
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "eval", "--format", "nope", "--model", "/nonexistent"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0


def test_cli_bench_cpu_runs_every_contender(tmp_path):
    png = tmp_path / "roofline.png"
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "bench", "cpu", "--quick", "--shapes", "256x512",
                        "--threads", "1", "--formats", "q4_0", "int4_g128", "--layouts", "lut4_i8_n16", "lut4_rowmajor",
                        "--rotate-mib", "8", "--png", str(png)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "DRAM read bandwidth" in out
    for name in ("torch fp32 F.linear", "aten int4pack g32", "q4_0 [lut4_i8_n16", "int4_g128 [lut4_rowmajor"):
        assert name in out, name
    assert out.count("| 256x512 |") == 2 * 8  # M in {1, 8} x 8 contenders
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_bench_roofline_model_table():
    from torch_lowbit.bench.roofline import RooflineRow, format_roofline
    # the check first on a table of stand-in numbers: the all-zero timings of a machine busy for the
    # whole measurement pass it
    machine = {"threads": 1, "clock_ghz": 0.1, "dram_gbs": 1.0, "bytes_per_cycle_per_core": 10.0}
    stand_in = [RooflineRow("int2_g64 [lut2_i8_n16]", 2.5, 640, 0.0, 0.0, 0.5, 0.0, 0.0, 80.0),
                RooflineRow("gcb2 [gcb_i8_n16]", 2.3125, 600, 3.0, 90.0, 0.5, 40.0, 12.5, 75.0)]
    _check_roofline_table(format_roofline(stand_in, machine, 1024, 2048))
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "bench", "roofline", "--shapes", "1024x2048", "--threads",
                        "1", "--formats", "int2_g64", "gcb2", "--rotate-mib", "8"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "GHz" in r.stdout and "bytes/cycle per core" in r.stdout
    _check_roofline_table(r.stdout)


def _check_roofline_table(out):
    """The table's structure, never its speed: the timed cells (cycles, µs, their ratios) hold whatever
    a busy machine measured (0 included), so they only have to be numbers >= 0."""
    import math

    import torch_lowbit as tl
    header = next(line for line in out.splitlines() if line.startswith("| kernel |"))
    assert len(header.strip("|").split("|")) == 12
    rows = [line for line in out.splitlines() if line.startswith("| int2_g64") or line.startswith("| gcb2")]
    assert len(rows) == 2 and "lut2_i8_n16" in rows[0] and "gcb_i8_n16" in rows[1]
    for row, fmt in zip(rows, ("int2_g64", "gcb2")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 12 and cells[-1] in ("compute", "memory")
        assert cells[1] == f"{tl.get_format(fmt).bits_per_weight():.3f}"
        assert all(math.isfinite(float(c)) and float(c) >= 0 for c in cells[1:11]), row


def test_clock_probe_measures_a_plausible_clock():
    # a busy machine only lowers the measured clock: no lower bound beyond > 0 (no verdict on a timing)
    from torch_lowbit.bench.roofline import clock_ghz
    assert 0 < clock_ghz(repeats=2) < 20.0


def test_cpu_path_forced_from_environment():
    code = "import torch_lowbit as tl; from torch_lowbit.ops import cpu_extension as c; print(c().get_cpu_path())"
    env = dict(__import__("os").environ, TORCH_LOWBIT_CPU_PATH="scalar")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "scalar", r.stderr[-1000:]
    env["TORCH_LOWBIT_CPU_PATH"] = "neon9"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "unknown CPU path 'neon9'" in r.stderr


def test_cli_bench_gpu_without_cuda_exits_with_clear_error():
    import torch
    if torch.cuda.is_available():
        import pytest
        pytest.skip("a CUDA GPU is present")
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "bench", "gpu", "--quick"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "bench gpu needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    # the GPU benches run build-free (what .ci/gpu all does while the C++ build runs): no extension needed
    # to get this far; bench cpu needs it and says how to build it, in one line
    env = dict(os.environ, TORCH_LOWBIT_NO_EXTENSION="1")
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "bench", "e2e", "--device", "cuda"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode != 0 and "bench e2e --device cuda needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "bench", "cpu", "--quick"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode != 0 and "pip install --no-build-isolation" in r.stderr and "Traceback" not in r.stderr


def test_bench_gpu_tables_on_tiny_cpu_inputs():
    """The GPU benchmark's loop and tables, run on CPU tensors (Triton interpreter, host clock)."""
    import pytest
    import torch

    from conftest import triton_available
    if not triton_available() or __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    import torch_lowbit as tl
    from torch_lowbit.bench import gpu
    from torch_lowbit.rotations.hadamard import hadamard_matrix
    with tl.use_backend("triton"):
        rows = gpu.bench_gpu(shapes=((64, 128),), ms=(1, 17),
                             formats=("q4_0", "int4_g128", "nuq3", "tcq2.25", "int2_g64", "gcb2_sb64"), rotate_mib=1, device="cpu", timer=gpu.wall_us, progress=lambda msg: None)
    assert [(r.m, r.name) for r in rows] == [(m, name) for m in (1, 17) for name in
                                            (gpu.BASELINE, "torch_lowbit q4_0 [lut4_rowmajor]",
                                             "torch_lowbit int4_g128 [lut4_rowmajor]",
                                             "torch_lowbit nuq3 [palette_packed]",
                                             "torch_lowbit tcq2.25 [palette_packed]",
                                             "torch_lowbit int2_g64 [stream_rowmajor]",
                                             "torch_lowbit gcb2_sb64 [gcb_rowmajor]")]
    # codes (nuq: 16 streams per row, each padded to a word) + fp16 row scales + int8 rotation signs
    from torch_lowbit.layouts.palette_packed import stream_words
    assert stream_words(128, 3) == 16 and rows[3].weight_bytes == 64 * 16 * 4 + 64 * 2 + 128
    assert rows[4].weight_bytes == 64 * 128 * 9 // 32 + 64 * 2 + 128  # 2.25 bits: halves at 2 and 2.5
    assert rows[0].weight_bytes == 64 * 128 * 2 and rows[1].weight_bytes == 64 * 128 // 2 + 64 * 4 * 2
    assert rows[5].weight_bytes == 64 * 128 // 4 + 64 * 2 * 2 * 2  # int2 codes + fp16 scales and mins
    # gcb: codes + a sub-group byte per 32 + fp16 superblock scales + the 16 x 4 int8 codebooks
    assert rows[6].weight_bytes == 64 * 128 // 4 + 64 * 4 + 64 * 2 * 2 + 64
    table = gpu.format_gpu_table(rows, "cpu (interpreter)")
    lines = [line for line in table.splitlines() if line.startswith("| 64x128 |")]
    assert len(lines) == 14 and all(line.count("|") == 10 for line in lines)
    assert lines[0].endswith("| 1.00x | - |")  # the baseline against itself; no CUDA graph on CPU
    ratio = float(lines[1].split("|")[-3].strip().rstrip("x"))
    assert abs(ratio - rows[0].us / rows[1].us) < 0.01
    graphed = [gpu.GpuRow("8x8", 1, gpu.BASELINE, 40.0, 128, 10.0), gpu.GpuRow("8x8", 1, "ours", 80.0, 32, 4.0)]
    assert gpu.format_gpu_table(graphed, "x").splitlines()[-1].endswith("| 80.0 | 4.0 | 0 | 0.00 | 0.50x | 2.50x |")

    h = hadamard_matrix(256)
    hrows = gpu.bench_hadamard(ms=(1, 3), n=256, fht=lambda x, scale: (x.float() @ h.T).half(), device="cpu",
                               timer=gpu.wall_us)
    htable = gpu.format_hadamard_table(hrows, 256)
    assert [r[0] for r in hrows] == [1, 3] and all(r[1] >= 0 and r[2] >= 0 for r in hrows)
    assert "| 3 |" in htable and htable.count("x |") == 2
    assert "| 1 | - |" in gpu.format_hadamard_table([[1, None, 5.0]])


def test_bench_gpu_dequantize_route_contenders():
    """`fmt@dequant` times the layer's op forced down the dequantize + mm route (CPU stand-in), with the
    same result as the fused kernel; rotated formats, activation suffixes and unknown routes are refused."""
    import pytest
    import torch

    from conftest import triton_available
    if not triton_available() or __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    import torch_lowbit as tl
    from torch_lowbit.bench import gpu
    with tl.use_backend("triton"):
        rows = gpu.bench_gpu(shapes=((64, 128),), ms=(17,), formats=("q4_0@dequant", "int2_g64@dequant"), rotate_mib=1,
                             device="cpu", timer=gpu.wall_us, progress=lambda msg: None)
        assert [r.name for r in rows] == [gpu.BASELINE, "torch_lowbit q4_0 [lut4_rowmajor, dequantize + cuBLAS]",
                                          "torch_lowbit int2_g64 [stream_rowmajor, dequantize + cuBLAS]"]
        contenders = gpu._contenders(64, 128, ("q4_0", "q4_0@dequant"), 0, "cpu")
        x = torch.randn(17, 128).half()
        fused, route = (make(0)(x) for make, _, _ in list(contenders.values())[1:])
        torch.testing.assert_close(route.float(), fused.float(), rtol=2e-3, atol=2e-3)
    for bad, why in (("nuq3@dequant", "without a rotation"), ("q4_0+a8@dequant", "weight-only"),
                     ("q4_0@fused", "unknown route")):
        with pytest.raises(ValueError, match=why):
            gpu._contenders(64, 128, (bad,), 0, "cpu")


def test_bench_weights_compares_formats_on_the_layers_all_hold(monkeypatch):
    import torch
    from torch_lowbit.bench import distortion
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    layers = [("a", torch.randn(32, 512, generator=gen)), ("b", torch.randn(16, 384, generator=gen))]
    monkeypatch.setattr(distortion, "model_linear_weights", lambda model: layers)
    quiet = lambda m: None  # noqa: E731
    rows = {r[0]: r for r in distortion.bench_weights("fake", ["int2_g64", "int3_g64"], progress=quiet)}
    assert rows["int2_g64"][2] == "2/2" and float(rows["int3_g64"][3]) < float(rows["int2_g64"][3])
    # with gcb2 listed, only the layers it holds count (384 is no multiple of its 256 superblock)
    rows = {r[0]: r for r in distortion.bench_weights("fake", ["int2_g64", "gcb2"], progress=quiet)}
    assert rows["int2_g64"][2] == rows["gcb2"][2] == "1/2"


def test_gcb_learn_writes_a_loadable_codebook_file(tmp_path, monkeypatch):
    import torch
    from torch_lowbit import cli
    from torch_lowbit.formats.gcb import GroupCodebook
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    with torch.no_grad():
        for m in model:
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen))
    monkeypatch.setattr(cli, "_load_model", lambda spec, dtype="float32": (model, None))
    out = tmp_path / "cb.safetensors"
    cli.main(["gcb-learn", "--model", "smollm2", "--count", "4", "--out", str(out)])
    fmt = GroupCodebook(bits=3, codebooks=str(out))
    assert fmt.name == "gcb3_cb" and fmt.table().shape == (4, 8)
    w = torch.randn(8, 256, generator=gen)
    assert float(((fmt.dequantize(fmt.quantize(w)) - w) ** 2).mean()) < 0.05 * float((w ** 2).mean())


def test_cli_checks_names_and_paths_before_any_work(tmp_path):
    cases = [(["eval", "--format", "q4_O"], "unknown format 'q4_O'"),
             (["eval", "--mix", "gcb2", "gcb9", "--target-bpw", "3"], "unknown format 'gcb9'"),
             (["eval", "--checkpoint", str(tmp_path / "nope.safetensors")], "nope.safetensors: no such file"),
             (["quantize", "--out", str(tmp_path / "missing" / "x.safetensors")], "does not exist or is not writable"),
             (["bench", "e2e", "--formats", "fp32", "q4_O"], "unknown format 'q4_O'"),
             (["eval", "--quarot", "W3A4KV4"], "W must be 4 or 16"),
             (["eval", "--quarot", "A4"], "expected W<bits>A<bits>[KV<bits>]"),
             (["eval", "--act-block", "16"], "--act-block 16: needs --quarot"),
             (["eval", "--quarot", "W16A4", "--act-block", "7"], "16, 8 or a multiple of 32"),
             (["eval", "--kv-group", "32"], "--kv-group 32: needs --quarot"),
             (["eval", "--sequential"], "--sequential calibrates layer by layer"),
             (["eval", "--msq"], "--msq needs --target-bpw and/or --target-latency-ms"),
             (["eval", "--target-latency-ms", "3"], "--target-latency-ms and --target-tokens-per-s go with --msq"),
             (["eval", "--msq", "--target-latency-ms", "3", "--target-tokens-per-s", "300"], "not both"),
             (["eval", "--mix", "gcb2", "gcb3", "--target-bpw", "3", "--sensitivity", "linearity"], "add --msq"),
             (["eval", "--msq", "--target-bpw", "3", "--sensitivity", "fisher", "--rounding", "rtn"],
              "needs calibration"),
             (["eval", "--msq", "--target-bpw", "3", "--quarot", "W4A4"], "cannot be combined")]
    for argv, message in cases:
        r = subprocess.run([sys.executable, "-m", "torch_lowbit", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr[-500:])
        assert "loading" not in r.stdout  # rejected before the model loads


def test_cli_prints_library_errors_as_one_line(tmp_path, monkeypatch, capsys):
    import pytest

    from conftest import tiny_llama
    from torch_lowbit import cli
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + bytes(range(64)))
    monkeypatch.setattr(cli, "_load_model", lambda spec, dtype="float32": (tiny_llama(), None))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "--checkpoint", str(corrupt)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("python -m torch_lowbit eval: error: ")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_extension_names_the_torch_it_was_built_against():
    import torch

    from torch_lowbit.ops import cpu_extension
    assert torch.__version__.startswith(cpu_extension().built_torch_version() + ".")


def test_gpu_host_profile_names_where_the_time_goes():
    """bench gpu --profile: the top functions by own time of an eager call (here a CPU stand-in)."""
    import torch

    from torch_lowbit.bench import gpu

    def inner(x):
        return torch.nn.functional.linear(x, torch.ones(8, 8))

    def call():
        return inner(torch.randn(2, 8))

    synced = []
    text = gpu.host_profile(call, calls=20, top=50, sync=lambda: synced.append(1))
    lines = text.splitlines()
    assert synced == [1] and lines[0].startswith("host time ") and "µs per call" in lines[0]
    body = lines[3:]
    assert 3 <= len(body) <= 50 and all(line.count("|") == 5 for line in body)
    inner_row = [line for line in body if "| inner (" in line and "test_cli.py:" in line]
    assert len(inner_row) == 1 and inner_row[0].split("|")[3].strip() == "1.0"  # one call of inner per call
    own = [float(line.split("|")[1]) for line in body]
    assert own == sorted(own, reverse=True)
