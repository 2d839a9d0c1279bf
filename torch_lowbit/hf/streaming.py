"""quantize_streaming: quantize a model larger than memory, one decoder block at a time.

The model is built on the meta device; only the tensors outside the decoder blocks (embeddings,
final norm, head) and one block at a time are read from the safetensors shards. Each block is
quantized with the same code as quantize_ (plan_jobs / quantize_job) and keeps only its packed
buffers (and small float tensors such as norms). With calibration the block's inputs are carried
from block to block as GPTQ's sequential mode does (calibrate/sequential.py, as quantize_(...,
sequential=True)): the batches' hidden states at the first block are captured once, each block's
layers are calibrated stage by stage on its inputs, and the *quantized* block's outputs become the
next block's inputs. Peak memory: the quantized model + one
float block + the calibration activations. The result is the HF folder save_pretrained writes.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Iterable, Mapping, Optional, Union

import torch
from safetensors import safe_open
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..calibrate.sequential import calibrate_layer, capture_layer_inputs, first_hidden, layer_outputs
from ..formats import Format
from ..io import CheckpointError
from ..nn import MixedBits
from ..nn.fusion import job_members
from ..nn.quantize import plan_jobs, quantize_job, rounding_args
from ..nn.select import ROUNDINGS, default_filter, rounding_for
from .load import save_pretrained
from .quantizer import _release_pages, _skipped, _untie_quantized

log = logging.getLogger(__name__)


class _Shards:
    """Reads single tensors from a folder's safetensors file(s), by name."""

    def __init__(self, folder: str):
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                self.file_of = {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.isfile(os.path.join(folder, "model.safetensors")):
            path = os.path.join(folder, "model.safetensors")
            with safe_open(path, framework="pt") as f:
                self.file_of = {k: path for k in f.keys()}
        else:
            raise FileNotFoundError(f"{folder} holds no model.safetensors(.index.json); quantize_streaming reads "
                                    "safetensors checkpoints (save the float model with save_pretrained first)")
        self._open: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str) -> Tensor:
        path = self.file_of[name]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_tensor(name)


def _decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(fqn, ModuleList) of the model's decoder blocks: the longest ModuleList."""
    lists = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of decoder blocks (nn.ModuleList); "
                         "quantize_streaming needs a block-structured model")
    return max(lists, key=lambda x: len(x[1]))


def _materialize(model: nn.Module, shards: _Shards, keys: list[str], source: str, region) -> None:
    """Loads the named state-dict entries from the shards (floats cast to the skeleton's dtype), then
    computes the non-persistent buffers (rotary tables) of the modules whose fqn `region` accepts,
    with transformers' own initialization (the loaded tensors are flagged as initialized)."""
    meta = model.state_dict(keep_vars=True)
    tensors = {}
    for k in keys:
        if k not in shards:
            raise CheckpointError(f"{source} has no tensor {k!r}, which {type(model).__name__} needs; is it the "
                                  "folder of this architecture?")
        t = shards.get(k)
        tensors[k] = t.to(meta[k].dtype) if t.is_floating_point() and meta[k].is_floating_point() else t
        tensors[k]._is_hf_initialized = True
    model.load_state_dict(tensors, strict=False, assign=True)
    for fqn, module in model.named_modules():
        meta_buffers = [n for n, b in module.named_buffers(recurse=False) if b.device.type == "meta"]
        if meta_buffers and region(fqn):
            for n in meta_buffers:
                module._buffers[n] = torch.empty_like(module._buffers[n], device="cpu")
            model._init_weights(module)


@torch.no_grad()
def quantize_streaming(src_dir: Union[str, os.PathLike], fmt: Union[str, Format, Mapping[str, Union[str, Format]]],
                       out_dir: Union[str, os.PathLike], *, rounding: Optional[str] = None,
                       calibration: Optional[Iterable[Tensor]] = None, fuse: bool = True, layout=None,
                       include_lm_head: bool = False, modules_to_not_convert: Optional[list[str]] = None,
                       max_shard_size: Union[int, str] = "5GB", progress: bool = True) -> None:
    """Quantizes the float causal LM in the HF folder src_dir (safetensors) block by block and writes
    the quantized HF folder out_dir (as save_pretrained; loads with from_pretrained after
    `import torch_lowbit`), plus the tokenizer if src_dir has one.

    fmt, fuse, layout, include_lm_head, rounding, calibration: as in torch_lowbit.quantize_, except
    that statistics are collected block by block on the inputs the already quantized blocks produce
    (GPTQ's sequential mode, as quantize_(..., sequential=True)), and a calibrated rounding does not
    reach layers outside the decoder blocks (include_lm_head needs rounding="rtn").
    modules_to_not_convert: module names / prefixes kept in float. rtn equals quantize_ of the float
    model exactly."""
    from transformers import AutoConfig, AutoModelForCausalLM
    src_dir, out_dir = os.fspath(src_dir), os.fspath(out_dir)
    rounding = rounding or ("imatrix" if calibration is not None else "rtn")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; choose one of {', '.join(ROUNDINGS)}")
    if rounding != "rtn" and calibration is None:
        raise ValueError(f"rounding={rounding!r} needs calibration batches (token ids); pass calibration=...")
    if isinstance(fmt, MixedBits):
        raise ValueError("quantize_streaming: MixedBits compares every layer before choosing; allocate on a model "
                         "that fits (torch_lowbit.allocate_formats) and pass the plan {fqn: format}")
    shards = _Shards(src_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src_dir), dtype=torch.float32)
    model.eval()
    blocks_fqn, blocks = _decoder_blocks(model)
    keep = default_filter(model, include_lm_head)
    plan, jobs, label = plan_jobs(
        model, fmt, fuse=fuse, include_lm_head=include_lm_head,
        filter_fn=lambda m, f: not _skipped(f, modules_to_not_convert) and (isinstance(fmt, Mapping) or keep(m, f)))
    in_block = lambda fqn, i: fqn.startswith(f"{blocks_fqn}.{i}.")  # noqa: E731
    outside = [j for j in jobs if not any(in_block(job_members(j)[0], i) for i in range(len(blocks)))]
    if outside and rounding != "rtn":
        raise ValueError(f"quantize_streaming: {job_members(outside[0])[0]} lies outside the decoder blocks, where "
                         "calibration statistics are not collected; keep it float or use rounding='rtn'")

    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    names = list(model.state_dict())
    head = [k for k in names if not k.startswith(f"{blocks_fqn}.") and not (k in tied and k not in shards)]
    _materialize(model, shards, head, src_dir, region=lambda f: not f.startswith(f"{blocks_fqn}.") and f != blocks_fqn)
    if tied:
        model.tie_weights()
    calls = capture_layer_inputs(model, blocks[0], calibration) if rounding != "rtn" else []
    hidden = [first_hidden(c) for c in calls]
    diagonal_only = not any(rounding_for(rounding, f) == "gptq" for f in plan)

    for i in tqdm(range(len(blocks)), desc=f"quantize {label} block by block", disable=None if progress else True):
        block = blocks[i]
        _materialize(model, shards, [k for k in names if k.startswith(f"{blocks_fqn}.{i}.")], src_dir,
                     region=lambda f: f == f"{blocks_fqn}.{i}" or f.startswith(f"{blocks_fqn}.{i}."))
        block_jobs = {job_members(j)[0]: j for j in jobs if in_block(job_members(j)[0], i)}
        fqns = [f for j in block_jobs.values() for f in job_members(j)]
        # stage by stage, each calibrated on the block with the stages before it quantized (q/k/v, o, gate/up, down)
        stages = calibrate_layer(block, fqns, model, calls, hidden, diagonal_only=diagonal_only) \
            if calls and fqns else [(fqns, {})]
        for stage, stats in stages:
            for job in [block_jobs.pop(f) for f in stage if f in block_jobs]:
                first = job_members(job)[0]
                linears = [model.get_submodule(f) for f in job_members(job)]
                consumed = [t for m in linears for t in (m.weight, m.bias) if t is not None]
                quantize_job(model, job, plan[first], layout=layout, **rounding_args(rounding, first, stats))
                for t in consumed:  # mmap'ed views of the checkpoint: unmap their pages (see _release_pages)
                    if t.is_contiguous():
                        _release_pages(t)
        if calls and i + 1 < len(blocks):  # sequential: the next block sees what the quantized one produces
            hidden = layer_outputs(block, calls, hidden)
        if progress:
            log.info("block %d/%d quantized", i + 1, len(blocks))
    for job in outside:
        quantize_job(model, job, plan[job_members(job)[0]], layout=layout)
    _untie_quantized(model)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise CheckpointError(f"quantize_streaming: tensors never loaded from {src_dir}: {left[:5]}")
    save_pretrained(model, out_dir, rounding=rounding, max_shard_size=max_shard_size)
    try:
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(src_dir).save_pretrained(out_dir)
    except (OSError, ValueError):  # a folder without a tokenizer
        pass
