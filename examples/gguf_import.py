"""Load a llama.cpp GGUF file straight into torch_lowbit (its Q4_0 / Q4_1 / IQ4_NL blocks kept as they
are), generate, measure perplexity, and write it back as GGUF.

    .venv/bin/python examples/gguf_import.py [--gguf PATH] [--tokens 1024] [--out out.gguf]

Default: SmolLM2-135M-Instruct's bundled Q4_1 file, whose Linear layers become int4_g32 QuantLinear
and whose Q8_0 token embedding a q8_0 QuantEmbedding shared with the tied head.
"""
import argparse
import logging
import tempfile
from pathlib import Path

import torch

import torch_lowbit as tl
from torch_lowbit.eval import perplexity, wiki_text
from torch_lowbit.eval.assets import smollm2_gguf

p = argparse.ArgumentParser()
p.add_argument("--gguf", default=None, help="a llama / qwen2 / qwen3 GGUF file (default: the bundled SmolLM2)")
p.add_argument("--tokens", type=int, default=1024, help="perplexity token budget (windows of 512)")
p.add_argument("--out", default=None, help="where to write the model back as GGUF (default: a temporary file)")
args = p.parse_args()
logging.basicConfig(level=logging.WARNING)

source = Path(args.gguf) if args.gguf else smollm2_gguf()
model, tok = tl.from_gguf(source)
formats = sorted({m.fmt.name for m in model.modules() if isinstance(m, tl.QuantLinear)})
print(f"{source.name}: {sum(isinstance(m, tl.QuantLinear) for m in model.modules())} QuantLinear modules "
      f"in {', '.join(formats)}")
print(model.model.layers[0])

ids = tok("The three laws of thermodynamics", return_tensors="pt").input_ids
gen = tl.CompiledGenerator(model, max_cache_len=128)  # static KV cache + torch.compile (the fast route)
gen.generate(ids, 20)  # the first call compiles (tens of seconds on a small CPU)
out = gen.generate(ids, 20)
print(tok.decode(out[0], skip_special_tokens=True))
print(f"compiled: prefill {gen.times.prefill_tokens_per_s:.0f} tok/s, decode {gen.times.decode_tokens_per_s:.1f} tok/s")

ppl = perplexity(model, tok, wiki_text(40), ctx=512, max_tokens=args.tokens, progress=False)
print(f"perplexity (Wikipedia, {args.tokens} tokens, default CPU backend): {ppl:.3f}")

with tempfile.TemporaryDirectory() as tmp:
    target = Path(args.out) if args.out else Path(tmp) / "roundtrip.gguf"
    tl.to_gguf(model, target, template=source)  # the tokenizer keys are copied from the source file
    print(f"wrote {target.name} ({target.stat().st_size / 2**20:.1f} MiB; source {source.stat().st_size / 2**20:.1f} MiB)")
