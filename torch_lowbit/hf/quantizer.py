"""The transformers quantizer for torch_lowbit (registered as quant_method "torch_lowbit").

Two ways in, both inside `from_pretrained`:

- quantize while loading (a float checkpoint + `quantization_config=LowbitConfig(...)`): the model
  is built on the meta device with its nn.Linear layers; each selected layer's weight (and bias)
  is handed to `LowbitQuantize` as it is read from the checkpoint instead of being stored. When
  all tensors of one job have arrived (one layer, or a q/k/v or gate/up group, which quantize_
  fuses into one module) they are quantized exactly as `torch_lowbit.quantize_` would and the
  QuantLinear takes the layers' place; the float tensors are dropped. At most one decoder
  block's projections wait in float at a time (the checkpoint is read in key order).
- load a saved folder (its config.json holds a LowbitConfig with `modules`): before loading, the
  listed Linear layers become empty QuantLinear shells (io.install_shells, shared with
  load_quantized), so the packed buffers in the safetensors shards load straight into them.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Optional

import torch
from torch import Tensor, nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer

from ..io import CheckpointError, install_shells, module_entries
from ..io.checkpoint import install_online_hadamards, online_hadamard_modules
from ..nn.act_quant import ActQuantLinear, unwrap_activation_quant, wrap_activation_quant
from ..nn import QuantLinear
from ..nn.linear import repack_for_this_cpu
from ..nn.fusion import Job, job_members
from ..nn.quantize import plan_jobs, quantize_job
from ..nn.select import default_filter
from .config import LowbitConfig


def _skipped(fqn: str, names: Optional[list[str]]) -> bool:
    return any(fqn == n or fqn.startswith(n + ".") for n in names or ())


_MADV_DONTNEED = 4
_libc = None


def _release_pages(t: Tensor) -> None:
    """Drops the resident pages of a consumed checkpoint tensor from this process (Linux).

    transformers reads safetensors through mmap: a float weight's pages stay resident (counted in
    the process's RSS) after we quantized it, so by the end of the load the whole float checkpoint
    would be resident. madvise(MADV_DONTNEED) on the pages lying wholly inside the tensor's bytes
    unmaps them (a later read would fault them in again from the file). Only called on tensors the
    loader handed us and nobody else holds."""
    global _libc
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or t.numel() == 0:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        _libc.madvise(first, last - first, _MADV_DONTNEED)  # advisory: a failure only leaves the pages resident


def _untie_quantized(model: nn.Module) -> None:
    """A tied LM head that is quantized has its own packed weight (the embedding stays float): drop
    the ties that name a QuantLinear, so transformers neither ties nor skips saving them, and record
    in the config that the weights are no longer tied."""
    quantized = {fqn for fqn, m in model.named_modules() if isinstance(m, QuantLinear)}
    untied = False
    for name, sub in model.named_modules():
        keys = sub.__dict__.get("all_tied_weights_keys")
        prefix = f"{name}." if name else ""
        for target, source in list((keys or {}).items()):
            if {f"{prefix}{target}".rpartition(".")[0], f"{prefix}{source}".rpartition(".")[0]} & quantized:
                del keys[target]
                untied = True
    if untied:
        for cfg in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
            if getattr(cfg, "tie_word_embeddings", False):
                cfg.tie_word_embeddings = False


def _mark_initialized(module: nn.Module) -> None:
    # transformers re-initializes tensors without this flag after loading
    module._is_hf_initialized = True
    for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        t._is_hf_initialized = True


class LowbitQuantize(ConversionOps):
    """Collects the float weight / bias of the layers to quantize as the loader reads them and
    quantizes each job once it is complete (the loader gets nothing back to store)."""

    def __init__(self, hf_quantizer: "LowbitHfQuantizer"):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict, model: Optional[nn.Module] = None, full_layer_name: Optional[str] = None,
                missing_keys: Optional[set] = None, **kwargs) -> dict[str, Tensor]:
        for name, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            self.hf_quantizer.receive(model, name, value)
            if missing_keys is not None:
                missing_keys.discard(name)
        return {}


class LowbitHfQuantizer(HfQuantizer):
    """transformers' side of torch_lowbit: see the module docstring."""

    requires_calibration = False
    quantization_config: LowbitConfig

    def __init__(self, quantization_config: LowbitConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._plan: dict = {}
        self._jobs: list[Job] = []
        self._job_of: dict[str, int] = {}  # member fqn -> index into _jobs
        self._needed: dict[int, set[str]] = {}  # job -> tensor names still to arrive
        self._received: dict[int, dict[str, Tensor]] = {}

    def validate_environment(self, *args, device_map=None, **kwargs):
        if not self.pre_quantized and self.quantization_config.modules is not None:
            raise ValueError("this LowbitConfig describes an already quantized model (it lists its modules); to "
                             "quantize a float checkpoint while loading pass a new LowbitConfig(format=...)")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("torch_lowbit models cannot be offloaded to disk; pass a device_map without 'disk' "
                             "(a quantized model is a fraction of its float size: try device_map='cpu')")

    # ---- before loading ------------------------------------------------------------------------
    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs):
        cfg = self.quantization_config
        if self.pre_quantized:
            if not cfg.modules:
                raise CheckpointError("the folder's config.json has a torch_lowbit quantization_config without "
                                      "'modules' (the quantized layers); save it again with save_pretrained")
            with torch.device("cpu"):  # from_pretrained builds under a meta-device context; the format tables are real
                install_online_hadamards(model, cfg.online_hadamard or [], "config.json quantization_config")
                install_shells(model, cfg.modules, "config.json quantization_config")
            _untie_quantized(model)
            return model
        keep = default_filter(model, cfg.include_lm_head)

        def filter_fn(module: nn.Module, fqn: str) -> bool:
            return not _skipped(fqn, cfg.modules_to_not_convert) and (isinstance(cfg.format, dict) or keep(module, fqn))

        self._plan, self._jobs, _ = plan_jobs(model, cfg.format, filter_fn=filter_fn, fuse=cfg.fuse,
                                              include_lm_head=cfg.include_lm_head)
        if not self._jobs:
            raise ValueError("LowbitConfig selects no Linear layer of this model (check the format plan's names and "
                             "modules_to_not_convert); for the float model load without quantization_config")
        for i, job in enumerate(self._jobs):
            self._needed[i] = set()
            for fqn in job_members(job):
                self._job_of[fqn] = i
                linear = model.get_submodule(fqn)
                self._needed[i].update(f"{fqn}.{t}" for t in ("weight", "bias") if getattr(linear, t) is not None)
        return model

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        fqn, _, tensor = param_name.rpartition(".")
        return fqn in self._job_of and tensor in ("weight", "bias")

    def get_quantize_ops(self):
        return LowbitQuantize(self)

    # ---- while loading -------------------------------------------------------------------------
    def receive(self, model: nn.Module, name: str, value: Tensor) -> None:
        """One float tensor of a layer to quantize; quantizes its job once the job is complete."""
        fqn = name.rpartition(".")[0]
        if fqn not in self._job_of:
            raise RuntimeError(f"torch_lowbit: {name} was sent to be quantized but is no selected layer's tensor")
        i = self._job_of[fqn]
        self._received.setdefault(i, {})[name] = value
        self._needed[i].discard(name)
        if not self._needed[i]:
            self._quantize(model, i)

    def _quantize(self, model: nn.Module, i: int) -> None:
        job, got = self._jobs[i], self._received.pop(i, {})
        members = job_members(job)
        weights, biases = [], []
        for fqn in members:
            linear = model.get_submodule(fqn)
            for t, out in (("weight", weights), ("bias", biases)):
                v = got.get(f"{fqn}.{t}", getattr(linear, t))  # not in the checkpoint: the module's own (tied)
                if v is not None and v.device.type == "meta":
                    raise CheckpointError(f"{fqn}.{t} is neither in the checkpoint nor initialized; cannot quantize it")
                out.append(v)
        with torch.no_grad():
            quantized = quantize_job(model, job, self._plan[members[0]], layout=self.quantization_config.layout,
                                     weights=weights, biases=biases)
        _mark_initialized(quantized)
        del self._needed[i]
        for t in got.values():  # the float tensors from the checkpoint are done with
            if t.is_contiguous():
                _release_pages(t)

    # ---- after loading -------------------------------------------------------------------------
    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs):
        for i in sorted(self._needed):  # tensors not in the checkpoint: tied (lm_head) or initialized by transformers
            self._quantize(model, i)
        _untie_quantized(model)
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.reset_runtime_buffers()  # transformers replaced non-persistent buffers by empty placeholders
        repack_for_this_cpu(model)  # a folder packed for another CPU (x86 tiles, ARM interleavings)
        if self.pre_quantized and self.quantization_config.act_quant:
            wrap_activation_quant(model, self.quantization_config.act_quant)
        self._describe(model)
        return model

    def _describe(self, model: nn.Module) -> None:
        from ..version import __version__
        cfg = self.quantization_config
        act_quant = unwrap_activation_quant(model)  # entries name the layers as a fresh skeleton has them
        try:
            cfg.modules = module_entries(model)
            cfg.online_hadamard = online_hadamard_modules(model) or None
        finally:
            wrap_activation_quant(model, act_quant)
        cfg.act_quant = act_quant or None
        cfg.torch_lowbit_version = __version__

    def get_state_dict_and_metadata(self, model: nn.Module):
        self._describe(model)  # save_pretrained writes config.json after this: the modules as they are now
        wrapped = [name for name, m in model.named_modules() if isinstance(m, ActQuantLinear)]
        if not wrapped:
            return None, {}
        state = {}  # tensors under the unwrapped names (what the skeleton of from_pretrained has)
        for key, value in model.state_dict().items():
            for name in wrapped:
                if key.startswith(f"{name}.layer."):
                    key = f"{name}.{key[len(name) + len('.layer.'):]}"
                    break
            state[key] = value
        return state, {}

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True
