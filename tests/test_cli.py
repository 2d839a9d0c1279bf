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
