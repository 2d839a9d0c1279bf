"""lm-evaluation-harness integration: the `lowbit` model (an HFLM handed a quantized model instance)
and an offline local perplexity task, `lowbit_wiki`, over the bundled Wikipedia lead sections.

    python -m torch_lowbit lm-eval --model lowbit --model_args pretrained=smollm2,format=q4_0 \
        --tasks lowbit_wiki --limit 8                     # any lm_eval arguments, lm-eval's own CLI
    python -m torch_lowbit lm-eval --model hf --model_args pretrained=<saved dir> --tasks ...
    torch_lowbit.eval.lm_eval_model.run_lm_eval("pretrained=smollm2,format=q4_0")   # Python
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .assets import cache_dir, smollm2_dir, wiki_articles

TASK_NAME = "lowbit_wiki"


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def build_quantized_model(pretrained: str = "smollm2", format: str = "q4_0", checkpoint: Optional[str] = None,
                          fuse: bool = True, skip_incompatible: bool = False, dtype: str = "float32"):
    """(model, tokenizer) for evaluation: `pretrained` (an HF folder, "smollm2") quantized to `format`
    ("none": float); a torch_lowbit HF folder as `pretrained`, or a `checkpoint` (such a folder, or a
    save_quantized file of `pretrained`), loads as it was saved (torch_lowbit.hf.load_quantized_model:
    no float weights on that route); a .gguf file as `pretrained` is imported with its blocks
    (torch_lowbit.from_gguf), then `format` applies only to its float layers ("none": as imported)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..hf import is_quantized_folder, load_quantized_model
    from ..io import from_gguf
    from ..nn import quantize_
    if pretrained == "smollm2":
        pretrained = str(smollm2_dir())
    if str(pretrained).endswith(".gguf"):
        model, tokenizer = from_gguf(pretrained, dtype=getattr(torch, dtype))
        if format and format.lower() != "none":
            quantize_(model, format, fuse=_flag(fuse), progress=False, skip_incompatible=True)
        return model, tokenizer
    if checkpoint is None and is_quantized_folder(pretrained):
        checkpoint = pretrained
    if checkpoint:
        model, tokenizer = load_quantized_model(checkpoint, base_model=pretrained)
        return model, tokenizer or AutoTokenizer.from_pretrained(pretrained)
    tokenizer = AutoTokenizer.from_pretrained(pretrained)
    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=getattr(torch, dtype)).eval()
    if format and format.lower() != "none":
        quantize_(model, format, fuse=_flag(fuse), progress=False, skip_incompatible=_flag(skip_incompatible))
    return model, tokenizer


@register_model("lowbit")
class LowbitLM(HFLM):
    """HFLM over a torch_lowbit-quantized model, handed to HFLM as an instance.

    model_args: pretrained (HF folder, "smollm2", a torch_lowbit HF folder or a .gguf file), format
    (default q4_0; none: float), checkpoint (a torch_lowbit folder or save_quantized file, loaded
    without the float weights), fuse (default true), skip_incompatible, dtype, plus HFLM's own
    (batch_size, max_length, ...). See build_quantized_model.
    """

    def __init__(self, pretrained: str = "smollm2", format: str = "q4_0", checkpoint: Optional[str] = None,
                 fuse: bool = True, skip_incompatible: bool = False, dtype: str = "float32", **kwargs):
        model, tokenizer = build_quantized_model(pretrained, format, checkpoint, fuse, skip_incompatible, dtype)
        super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)
        self.lowbit_format = "checkpoint" if checkpoint else format


def tasks_dir(n_docs: int = 64) -> Path:
    """A folder holding the `lowbit_wiki` task YAML and its JSONL documents (written on demand)."""
    d = cache_dir() / "lm_eval_tasks"
    d.mkdir(parents=True, exist_ok=True)
    docs = d / f"wiki_{n_docs}.jsonl"
    if not docs.exists():
        with open(docs.with_suffix(".tmp"), "w", encoding="utf-8") as f:
            for text in wiki_articles()[:n_docs]:
                f.write(json.dumps({"text": text}) + "\n")
        os.replace(docs.with_suffix(".tmp"), docs)
    config = {
        "task": TASK_NAME, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(docs)}},
        "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                        {"metric": "bits_per_byte"}],
        "metadata": {"version": 1.0, "n_docs": n_docs},
    }
    (d / f"{TASK_NAME}.yaml").write_text(json.dumps(config, indent=1))  # JSON is valid YAML
    return d


def run_lm_eval_cli(argv: Sequence[str]) -> None:
    """lm-eval's own command line (`lm_eval ...` with these arguments) in this process, where the
    `lowbit` model and the torch_lowbit HF quantizer are registered. Without --include_path, the
    folder of the local `lowbit_wiki` task is included."""
    from lm_eval.__main__ import cli_evaluate
    argv = list(argv)
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in argv) and \
            any(a.startswith("--tasks") or a == "-t" for a in argv) and TASK_NAME in " ".join(argv):
        argv += ["--include_path", str(tasks_dir())]
    saved = sys.argv
    sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


def run_lm_eval(model_args: str, *, n_docs: int = 64, limit: Optional[int] = None, batch_size: int = 1) -> dict:
    """Runs `lowbit` on the local task offline; returns lm-eval's results dict for the task."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager
    manager = TaskManager(include_path=str(tasks_dir(n_docs)), include_defaults=False)
    out = lm_eval.simple_evaluate(model="lowbit", model_args=model_args, tasks=[TASK_NAME],
                                  task_manager=manager, limit=limit, batch_size=batch_size)
    return out["results"][TASK_NAME]
