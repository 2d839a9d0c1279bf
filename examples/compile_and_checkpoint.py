"""Quantize once, save a checkpoint, load it into a meta-device skeleton, run it under
torch.compile(fullgraph=True) and check it matches eager.

    .venv/bin/python examples/compile_and_checkpoint.py
"""
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import torch_lowbit as tl
from torch_lowbit.eval import load_smollm2, smollm2_dir

model, tok = load_smollm2()
tl.quantize_(model, "int4_g64")
path = Path(tempfile.mkdtemp()) / "smollm2_int4_g64.safetensors"
tl.save_quantized(model, path)
print(f"saved {path} ({path.stat().st_size / 1e6:.1f} MB)")

config = AutoConfig.from_pretrained(smollm2_dir())
with torch.device("meta"):
    skeleton = AutoModelForCausalLM.from_config(config)
loaded = tl.load_quantized(skeleton, path).eval()

ids = tok("Compilers turn programs into", return_tensors="pt").input_ids
compiled = torch.compile(loaded, fullgraph=True)
with torch.no_grad():
    eager = loaded(ids).logits
    comp = compiled(ids).logits
diff = (comp - eager).abs().max().item()
print("max |compiled - eager| =", diff)
assert diff < 0.05 * eager.abs().max().item(), "compiled output differs from eager"
