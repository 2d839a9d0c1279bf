"""The Hugging Face route: quantize while loading, save_pretrained, from_pretrained, generate.

    .venv/bin/python examples/hf_quantize_save_load.py [--format q4_0] [--model HF_DIR] [--out DIR]

Runs offline on the bundled SmolLM2-135M (fp32 folder from torch_lowbit.eval.assets).
"""
import argparse
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import torch_lowbit as tl
from torch_lowbit.hf import LowbitConfig

p = argparse.ArgumentParser()
p.add_argument("--format", default="q4_0")
p.add_argument("--model", default=None, help="a float HF folder (default: the bundled SmolLM2-135M)")
p.add_argument("--out", default=None, help="where to save the quantized folder (default: a temporary one)")
args = p.parse_args()
if args.model is None:
    from torch_lowbit.eval.assets import smollm2_dir
    args.model = str(smollm2_dir())
tmp = None if args.out else tempfile.TemporaryDirectory(prefix="lowbit_hf_")
out = args.out or tmp.name

# 1. quantize while loading: each Linear weight is quantized as it is read, no fp32 model in memory
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                             quantization_config=LowbitConfig(args.format))
tok = AutoTokenizer.from_pretrained(args.model)

# 2. a normal HF folder: config.json (+ quantization_config), safetensors of the packed buffers, tokenizer
model.save_pretrained(out)
tok.save_pretrained(out)
print(f"saved to {out}:", ", ".join(sorted(os.listdir(out))))

# 3. load it back straight into QuantLinear modules (no re-quantization) and generate
loaded = AutoModelForCausalLM.from_pretrained(out)
tok = AutoTokenizer.from_pretrained(out)
print(loaded.model.layers[0].self_attn)
ids = tok("The three laws of thermodynamics", return_tensors="pt").input_ids
with torch.no_grad():
    a = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=tok.eos_token_id)
    b = loaded.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=tok.eos_token_id)
assert torch.equal(a, b), "the loaded folder generates what the model that saved it did"
print(tok.decode(b[0], skip_special_tokens=True))
print(f"{sum(isinstance(m, tl.QuantLinear) for m in loaded.modules())} QuantLinear modules, "
      f"format {args.format}")
if tmp is not None:
    tmp.cleanup()
