"""Every script in examples/ runs as a user would run it (on the bundled SmolLM2, so: slow)."""
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# small arguments where a script takes them: the point is that it runs, not its numbers
ARGS = {"lm_eval_run.py": ["--docs", "4", "--limit", "4"], "gguf_import.py": ["--tokens", "512"]}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs(script):
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *ARGS.get(script, [])], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), "an example prints what it did"
