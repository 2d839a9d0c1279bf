"""Evaluation: offline assets (SmolLM2, Wikipedia), perplexity, and the lm-eval `lowbit` model
(torch_lowbit.eval.lm_eval_model, imported on demand: it needs the [eval] extra)."""
from .assets import cache_dir, load_smollm2, smollm2_dir, wiki_text
from .perplexity import perplexity

__all__ = ["cache_dir", "load_smollm2", "smollm2_dir", "wiki_text", "perplexity"]
