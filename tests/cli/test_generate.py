"""python -m torch_lowbit generate (and the demo) on a tiny random-weight Llama with SmolLM2's
tokenizer: streamed text on stdout, the speed line on stderr, arguments checked before any work."""
import subprocess
import sys

import pytest
import torch

from conftest import tiny_llama
from torch_lowbit import cli


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A Hugging Face folder: a 2-layer random Llama with SmolLM2's vocabulary, tokenizer and chat template."""
    from transformers import AutoTokenizer

    from torch_lowbit.eval.assets import smollm2_dir
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(tok), hidden_size=64, intermediate_size=128, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _generate(capsys, *argv):
    cli.main(["generate", *map(str, argv), "--no-compile"])
    out = capsys.readouterr()
    return out.out, out.err.strip().splitlines()


def test_generate_streams_text_and_reports_speed(tiny_folder, capsys):
    out, err = _generate(capsys, tiny_folder, "--prompt", "What is a star?", "--max-new-tokens", "6")
    assert out.strip() and "What is a star?" not in out  # the continuation only
    assert err[-1].startswith("prefill ") and " tok/s (" in err[-1] and "decode " in err[-1]
    assert "(6 new tokens)" in err[-1] or "new tokens)" in err[-1]
    assert not any("instead of the fast route" in line for line in err)
    chat_prompt = int(err[-1].split("(")[1].split()[0])
    out, err = _generate(capsys, tiny_folder, "--prompt", "What is a star?", "--max-new-tokens", "6", "--raw")
    assert out.startswith("What is a star?")  # --raw: the text continued, printed with its continuation
    assert int(err[-1].split("(")[1].split()[0]) < chat_prompt  # no chat template around it


def test_generate_sampling_with_a_seed_repeats_and_quantizes_on_request(tiny_folder, capsys):
    argv = (tiny_folder, "--prompt", "Hello", "--max-new-tokens", "8", "--temperature", "1.3", "--top-p", "0.95",
            "--seed", "5", "--format", "q4_0+q8_0")
    first, err = _generate(capsys, *argv)
    assert any("quantizing to q4_0 (rtn) + q8_0 embedding/head" in line for line in err)
    again, _ = _generate(capsys, *argv)
    assert first == again


def test_generate_checks_its_arguments_before_loading(tmp_path):
    cases = [(["--temperature", "0"], "--temperature 0.0: temperature must be a finite number > 0"),
             (["--top-p", "1.5"], "--top-p 1.5: top_p must be in (0, 1]"),
             (["--top-k", "-2"], "--top-k -2: top_k must be an int >= 0"),
             (["--seed", "3"], "--seed goes with sampling"),
             (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
             (["--format", "q4_0+q9"], "unknown format 'q9'")]
    for extra, message in cases:
        r = subprocess.run([sys.executable, "-m", "torch_lowbit", "generate", "smollm2", "--prompt", "hi", *extra],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr[-400:])
        assert "loading" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "generate", str(tmp_path / "no.gguf"), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no.gguf: no such file" in r.stderr


def test_demo_prints_fp32_and_the_fast_route_side_by_side(tiny_folder, monkeypatch, capsys):
    """The demo's table on the tiny model (eager loop, RTN, few tokens): SmolLM2's loader swapped out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    monkeypatch.setattr(cli, "_load_model", lambda spec, dtype="float32": (
        AutoModelForCausalLM.from_pretrained(tiny_folder).eval(), AutoTokenizer.from_pretrained(tiny_folder)))
    cli.main(["demo", "--rounding", "rtn", "--tokens", "256", "--ctx", "128", "--prompt-tokens", "16", "--gen", "4",
              "--repeats", "1", "--no-compile"])
    out = capsys.readouterr().out
    assert "| fp32 | transformers eager |" in out
    assert "| q4_0 (rtn) + q8_0 embedding/head | torch_lowbit.generate, eager loop |" in out
    assert "threads" in out and "perplexity change:" in out and "sample (" in out
