"""Swap the Linear layers of a Hugging Face causal LM for torch_lowbit QuantLinear and generate.

    .venv/bin/python examples/hf_swap.py [--format q4_0] [--model smollm2|HF_DIR]
"""
import argparse

import torch

import torch_lowbit as tl
from torch_lowbit.eval.assets import calibration_batches, load_smollm2

p = argparse.ArgumentParser()
p.add_argument("--format", default="q4_0")
p.add_argument("--model", default="smollm2")
p.add_argument("--rounding", default="rtn", choices=["rtn", "imatrix", "gptq", "mixed"])
args = p.parse_args()

if args.model == "smollm2":
    model, tok = load_smollm2()
else:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = AutoModelForCausalLM.from_pretrained(args.model).eval(), AutoTokenizer.from_pretrained(args.model)

calib = calibration_batches(tok, 16, 512) if args.rounding != "rtn" else None
tl.quantize_(model, args.format, calibration=calib, rounding=args.rounding)
print(model.model.layers[0])

ids = tok("The three laws of thermodynamics", return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.eos_token_id)
print(tok.decode(out[0], skip_special_tokens=True))
