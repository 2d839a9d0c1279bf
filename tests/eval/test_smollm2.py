"""Real model, real text (slow): SmolLM2-135M-Instruct on the first 4096 Wikipedia tokens.

Note: this GGUF's weights already sit on an asymmetric 4-bit group-32 grid, so int4_g32 is lossless
on it and proves nothing; these tests use q4_0.
"""
import copy
import math
import subprocess
import sys

import pytest
import torch

import torch_lowbit as tl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def text():
    from torch_lowbit.eval import wiki_text
    return wiki_text(400)


@pytest.fixture(scope="module")
def fp32_ppl(smollm2, text):
    from torch_lowbit.eval import perplexity
    model, tok = smollm2
    return perplexity(model, tok, text, ctx=512, max_tokens=4096, progress=False)


def test_q4_0_perplexity_within_10_percent(smollm2, text, fp32_ppl):
    from torch_lowbit.eval import perplexity
    from torch_lowbit.eval.assets import calibration_batches
    model, tok = smollm2
    assert 10 < fp32_ppl < 25
    q = copy.deepcopy(model)
    tl.quantize_(q, "q4_0", calibration=calibration_batches(tok, 32, 512), rounding="mixed", progress=False)
    ppl = perplexity(q, tok, text, ctx=512, max_tokens=4096, progress=False)
    print(f"fp32 {fp32_ppl:.3f}  q4_0 (mixed calibration) {ppl:.3f}")
    assert ppl < 1.10 * fp32_ppl


def test_q4_0_rtn_is_a_real_4bit_model(smollm2, text, fp32_ppl):
    """Data-free ggml rounding: worse than calibrated, still a working model (README explains the gap)."""
    from torch_lowbit.eval import perplexity
    model, tok = smollm2
    q = copy.deepcopy(model)
    tl.quantize_(q, "q4_0", progress=False)
    ppl = perplexity(q, tok, text, ctx=512, max_tokens=4096, progress=False)
    print(f"fp32 {fp32_ppl:.3f}  q4_0 (rtn) {ppl:.3f}")
    assert fp32_ppl < ppl < 1.4 * fp32_ppl


def test_lm_eval_command_line_runs_the_local_task_offline(tmp_path):
    """`python -m torch_lowbit lm-eval <lm_eval's own arguments>` runs lm-eval's CLI with the `lowbit`
    model registered; its numbers equal the same evaluation run in-process."""
    import json
    import os

    from torch_lowbit.eval.lm_eval_model import run_lm_eval
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "lm-eval", "--model", "lowbit", "--model_args",
                        "pretrained=smollm2,format=q4_0", "--tasks", "lowbit_wiki", "--limit", "4",
                        "--output_path", str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    files = list(tmp_path.rglob("results_*.json"))
    assert len(files) == 1, files
    cli = json.loads(files[0].read_text())["results"]["lowbit_wiki"]
    res = run_lm_eval("pretrained=smollm2,format=q4_0", limit=4)
    wp = res["word_perplexity,none"]
    assert math.isfinite(wp) and 1 < wp < 1e4
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert cli[metric] == pytest.approx(res[metric], rel=1e-9), metric

    # `quantize --out DIR` streams SmolLM2 block by block into a Hugging Face folder; lm-eval's own `hf`
    # model loads it (from_pretrained, with torch_lowbit's quantizer registered) and scores the same
    folder = tmp_path / "smollm2-q4_0"
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "quantize", "--format", "q4_0", "--out", str(folder)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0 and (folder / "config.json").exists(), r.stderr[-3000:]
    out = tmp_path / "hf_run"
    r = subprocess.run([sys.executable, "-m", "torch_lowbit", "lm-eval", "--model", "hf", "--model_args",
                        f"pretrained={folder}", "--device", "cpu", "--tasks", "lowbit_wiki", "--limit", "4",
                        "--output_path", str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    hf = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["lowbit_wiki"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert hf[metric] == pytest.approx(res[metric], rel=1e-6), metric


def test_cli_quantize_then_eval_checkpoint(tmp_path):
    ckpt = tmp_path / "smollm2_q4_0.safetensors"
    run = lambda *a: subprocess.run([sys.executable, "-m", "torch_lowbit", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=600)
    r = run("quantize", "--format", "q4_0", "--out", str(ckpt))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run("eval", "--checkpoint", str(ckpt), "--tokens", "1024")
    assert r.returncode == 0, r.stderr[-2000:]
    ppl = float(r.stdout.strip().split()[-1])
    assert 10 < ppl < 40


def test_gcb_mix_at_3_2_bpw_lands_between_gcb2_and_gcb3(smollm2, text):
    """The allocator on real layers: a ~3.2 bits-per-weight gcb2/gcb3 mix (imatrix) is better than
    gcb2 and worse than gcb3. Blocks 0-2 only (the rest stays float) and 2048 tokens, to stay within
    a few minutes; README has the whole-model numbers."""
    from torch_lowbit.eval import perplexity
    from torch_lowbit.eval.assets import calibration_batches
    from torch_lowbit.nn import mix_summary, quantized_bpw
    model, tok = smollm2
    calib = calibration_batches(tok, 4, 512)
    blocks = lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn.startswith(  # noqa: E731
        ("model.layers.0.", "model.layers.1.", "model.layers.2."))
    ppl, bpw = {}, {}
    for name, fmt in [("gcb2", "gcb2_sb192"), ("gcb3", "gcb3_sb192"),
                      ("mix", tl.MixedBits(["gcb2_sb192", "gcb3_sb192"], 3.2))]:
        q = copy.deepcopy(model)
        tl.quantize_(q, fmt, calibration=calib, rounding="imatrix", filter_fn=blocks, progress=False)
        with tl.use_backend("reference"):
            ppl[name] = perplexity(q, tok, text, ctx=512, max_tokens=2048, progress=False)
        bpw[name] = quantized_bpw(q)
    print(ppl, bpw, mix_summary(q), sep="\n")
    assert 3.0 < bpw["mix"] <= 3.2 and "| gcb2_sb192 | gcb3_sb192 |" in mix_summary(q)
    assert ppl["gcb3"] < ppl["mix"] < ppl["gcb2"]


def test_quarot_rotation_keeps_fp32_perplexity(smollm2, text, fp32_ppl):
    """rotate_ changes every weight of SmolLM2 (576 = 36 * 16 residual, 1536 = 12 * 128 online
    Hadamard before down_proj) but not its function: perplexity equal to 4 digits."""
    from torch_lowbit.eval import perplexity
    model, tok = smollm2
    r = tl.rotate_(copy.deepcopy(model), seed=0)
    ppl = perplexity(r, tok, text, ctx=512, max_tokens=4096, progress=False)
    print(f"fp32 {fp32_ppl:.4f}  rotated fp32 {ppl:.4f}")
    assert abs(ppl - fp32_ppl) < 5e-4 * fp32_ppl
