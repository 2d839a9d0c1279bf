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


def test_cli_bench_cpu_runs_every_contender():
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "bench", "cpu", "--quick", "--shapes", "256x512",
                        "--threads", "1", "--formats", "q4_0", "int4_g128", "--layouts", "lut4_i8_n16", "lut4_rowmajor",
                        "--rotate-mib", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "DRAM read bandwidth" in out
    for name in ("torch fp32 F.linear", "aten int4pack g32", "q4_0 [lut4_i8_n16", "int4_g128 [lut4_rowmajor"):
        assert name in out, name
    assert out.count("| 256x512 |") == 2 * 8  # M in {1, 8} x 8 contenders
