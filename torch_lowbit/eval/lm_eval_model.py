"""lm-evaluation-harness integration: the `lowbit` model (an HFLM that quantizes on load) and an
offline local perplexity task, `lowbit_wiki`, over the bundled Wikipedia lead sections.

    python -m torch_lowbit eval --lm-eval --format q4_0           # CLI
    torch_lowbit.eval.lm_eval_model.run_lm_eval("pretrained=smollm2,format=q4_0")   # Python
    lm_eval --model lowbit --model_args pretrained=smollm2,format=q4_0 \
            --include_path "$(python -m torch_lowbit lm-eval-tasks)" --tasks lowbit_wiki
      (the last needs `import torch_lowbit.eval.lm_eval_model` registered, e.g. via the CLI above)
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from transformers import AutoTokenizer

from ..hf import is_quantized_folder, load_quantized_model
from ..nn import quantize_
from .assets import cache_dir, smollm2_dir, wiki_articles

TASK_NAME = "lowbit_wiki"


@register_model("lowbit")
class LowbitLM(HFLM):
    """HFLM whose Linear layers are quantized right after loading.

    model_args: pretrained (HF dir or "smollm2"), format (default q4_0), checkpoint (a
    save_quantized file of `pretrained`, or a torch_lowbit HF folder, to load instead of
    quantizing: torch_lowbit.hf.load_quantized_model, no float detour), fuse (default True),
    skip_incompatible, plus HFLM's own (dtype, batch_size, ...). format=none evaluates the float
    model. A torch_lowbit HF folder as `pretrained` loads as it was saved.
    """

    def __init__(self, pretrained: str = "smollm2", format: str = "q4_0", checkpoint: Optional[str] = None,
                 fuse: bool = True, skip_incompatible: bool = False, **kwargs):
        if pretrained == "smollm2":
            pretrained = str(smollm2_dir())
        kwargs.setdefault("device", "cpu")
        if checkpoint is None and is_quantized_folder(pretrained):
            checkpoint = pretrained
        if checkpoint:  # HFLM takes the loaded model object (and then ignores `device`)
            model, tok = load_quantized_model(checkpoint, base_model=pretrained, device=kwargs.pop("device"))
            super().__init__(pretrained=model, tokenizer=tok or AutoTokenizer.from_pretrained(pretrained), **kwargs)
        else:
            super().__init__(pretrained=pretrained, **kwargs)
            if format and format.lower() != "none":
                fuse = fuse if isinstance(fuse, bool) else str(fuse).lower() == "true"
                quantize_(self._model, format, fuse=fuse, progress=False,
                          skip_incompatible=str(skip_incompatible).lower() == "true")
        self.lowbit_format = format


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
