"""Peak memory of the Hugging Face loading routes, each in a fresh interpreter:

    python -m torch_lowbit.tools.hf_load_memory [--model HF_DIR] [--format q4_0]

Routes: `baseline` (import torch, transformers and torch_lowbit, build the model on the meta
device: the floor every route pays), `fp32` (from_pretrained of the float folder), `fp32+quantize_`
(the float load, then torch_lowbit.quantize_), `quantize-on-load` (from_pretrained with
LowbitConfig), `load-folder` (from_pretrained of the saved quantized folder) and `load-file`
(load_quantized_model of a save_quantized file + its base folder).

Every route but the baseline and quantize_streaming ends with one forward pass (8 tokens), so the weights it keeps have
been read. Per route it reports the process's peak resident set (VmHWM, not ru_maxrss: Linux carries a
parent's resident set at fork into the child's ru_maxrss, so a big test process would show in every
route; it includes pages of the mmap'ed
safetensors that were read, which the kernel can drop under pressure) and the peak of its
anonymous memory (RssAnon sampled every millisecond: tensors the process owns). docs/hf.md lists
the numbers of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROUTES = ("baseline", "fp32", "fp32+quantize_", "quantize-on-load", "load-folder", "load-file", "quantize_streaming")

# run in the child: `route`, `src`, `fmt`, `qdir`, `qfile` are set before this
_CHILD = r'''
import json, resource, threading, time

peak_anon = [0]
def _status_kb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0
def _anon_kb():
    return _status_kb("RssAnon")
def _peak_rss_kb():  # this exec's own high-water mark (ru_maxrss would include the parent's at fork)
    return _status_kb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
stop = False
def _sample():
    while not stop:
        peak_anon[0] = max(peak_anon[0], _anon_kb())
        time.sleep(0.001)
threading.Thread(target=_sample, daemon=True).start()

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
import torch_lowbit as tl
from torch_lowbit.hf import LowbitConfig, load_quantized_model
if route == "baseline":
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
elif route == "fp32":
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
elif route == "fp32+quantize_":
    model = tl.quantize_(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), fmt, progress=False)
elif route == "quantize-on-load":
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, quantization_config=LowbitConfig(fmt))
elif route == "load-folder":
    model = AutoModelForCausalLM.from_pretrained(qdir)
elif route == "load-file":
    model, _ = load_quantized_model(qfile, base_model=src)
elif route == "quantize_streaming":
    import tempfile
    from torch_lowbit.hf import quantize_streaming
    with tempfile.TemporaryDirectory() as out:
        quantize_streaming(src, fmt, out, progress=False)
if route not in ("baseline", "quantize_streaming"):  # ready to run: one forward reads every weight (mmap'ed pages become resident)
    with torch.no_grad():
        model(torch.arange(8).unsqueeze(0))
time.sleep(0.01)
stop = True
print(json.dumps({"route": route, "peak_rss_mb": _peak_rss_kb() / 1024,
                  "peak_anon_mb": max(peak_anon[0], _anon_kb()) / 1024}))
'''


def measure(route: str, src: str, fmt: str, qdir: str = "", qfile: str = "") -> dict:
    """Peak memory (MiB) of one route in a fresh interpreter."""
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; choose one of {', '.join(ROUTES)}")
    code = f"route, src, fmt, qdir, qfile = {route!r}, {src!r}, {fmt!r}, {qdir!r}, {qfile!r}\n" + _CHILD
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"route {route} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def save_quantized_copies(src: str, fmt: str, out: str) -> tuple[str, str]:
    """(folder, file): src quantized to fmt, saved with save_pretrained (+ tokenizer) and save_quantized."""
    code = (f"import torch, torch_lowbit as tl\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"from torch_lowbit.hf import LowbitConfig\n"
            f"m = AutoModelForCausalLM.from_pretrained({src!r}, dtype=torch.float32, "
            f"quantization_config=LowbitConfig({fmt!r}))\n"
            f"m.save_pretrained({out!r} + '/folder'); AutoTokenizer.from_pretrained({src!r}).save_pretrained({out!r} + '/folder')\n"
            f"tl.save_quantized(m, {out!r} + '/model.safetensors')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1"), timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"saving the quantized copies failed:\n{r.stderr[-3000:]}")
    return os.path.join(out, "folder"), os.path.join(out, "model.safetensors")


def _size_mb(path: str) -> float:
    if os.path.isfile(path):
        return os.path.getsize(path) / 2 ** 20
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")) / 2 ** 20


def run(src: str, fmt: str, routes=ROUTES) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        qdir, qfile = save_quantized_copies(src, fmt, tmp)
        sizes = {"fp32_checkpoint_mb": _size_mb(src), "quantized_folder_mb": _size_mb(qdir),
                 "quantized_file_mb": _size_mb(qfile)}
        return {"sizes": sizes, "routes": [measure(r, src, fmt, qdir, qfile) for r in routes]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a float HF folder (default: the bundled SmolLM2-135M)")
    p.add_argument("--format", default="q4_0")
    args = p.parse_args(argv)
    if args.model is None:
        from ..eval.assets import smollm2_dir
        args.model = str(smollm2_dir())
    result = run(args.model, args.format)
    print(json.dumps(result["sizes"]))
    print(f"{'route':<18} {'peak RSS MiB':>13} {'peak anon MiB':>14}")
    for r in result["routes"]:
        print(f"{r['route']:<18} {r['peak_rss_mb']:>13.0f} {r['peak_anon_mb']:>14.0f}")


if __name__ == "__main__":
    main()
