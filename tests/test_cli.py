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


def test_cpu_path_forced_from_environment():
    code = "import torch_lowbit as tl; from torch_lowbit.ops.library import cpu_extension as c; print(c().get_cpu_path())"
    env = dict(__import__("os").environ, TORCH_LOWBIT_CPU_PATH="scalar")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "scalar", r.stderr[-1000:]
    env["TORCH_LOWBIT_CPU_PATH"] = "neon9"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "unknown CPU path 'neon9'" in r.stderr
