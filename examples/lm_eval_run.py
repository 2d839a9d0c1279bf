"""Run lm-evaluation-harness with the `lowbit` model on the offline local Wikipedia perplexity task.

    .venv/bin/python examples/lm_eval_run.py [--format q4_0] [--docs 64] [--limit N]

The same from lm-eval's own command line (any lm_eval arguments):
    python -m torch_lowbit lm-eval --model lowbit --model_args pretrained=smollm2,format=q4_0 --tasks lowbit_wiki
"""
import argparse

from torch_lowbit.eval.lm_eval_model import run_lm_eval

p = argparse.ArgumentParser()
p.add_argument("--format", default="q4_0")
p.add_argument("--docs", type=int, default=64)
p.add_argument("--limit", type=int, default=None)
args = p.parse_args()
for fmt in ("none", args.format):
    res = run_lm_eval(f"pretrained=smollm2,format={fmt}", n_docs=args.docs, limit=args.limit)
    print(fmt, {k: round(v, 4) for k, v in res.items() if isinstance(v, float)})
