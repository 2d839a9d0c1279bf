"""Quantized checkpoints: one safetensors file (no pickle) whose JSON metadata says, per quantized
module, its format config, layout (name + version), shapes and fusion, plus a CRC32 per tensor.

Loading rebuilds the QuantLinear and QuantEmbedding modules (entries with "module": "embedding")
on a float (or meta-device) skeleton of the same architecture and assigns every tensor, so nothing
is quantized or repacked again. Tensors sharing storage (a head tied to a QuantEmbedding) are
stored once and listed as aliases; loading hands both modules the same tensor.
"""
from __future__ import annotations

import json
import os
import zlib
from typing import Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from ..formats import format_from_json
from ..layouts import get_layout
from ..nn.act_quant import unwrap_activation_quant, wrap_activation_quant
from ..nn.embedding import QuantEmbedding
from ..nn.fusion import ProjectionSlot, install_fused
from ..nn.linear import QuantLinear, repack_for_this_cpu
from ..quarot import kv_cache_config, set_kv_cache_config
from ..rotations.model import OnlineHadamardLinear

CHECKPOINT_VERSION = 1
_META_KEY = "torch_lowbit"
_NONPERSISTENT = "__nonpersistent__."


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: wrong version, corrupt or truncated file, wrong skeleton."""


def _crc(t: Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())


def module_entries(model: nn.Module) -> dict[str, dict]:
    """{fqn: entry} for every QuantLinear of the model: its format config (kind + version), layout
    (name + version), shapes, bias and fusion; what install_shells needs to rebuild it empty. Shared by
    save_quantized (file metadata) and the Hugging Face route (config.json's quantization_config)."""
    entries = {}
    fused_parents = {}
    for pfqn, parent in model.named_modules():
        for names, fused_name in getattr(parent, "_lowbit_fusions", []):
            fused_parents[f"{pfqn}.{fused_name}" if pfqn else fused_name] = list(names)
    for fqn, m in model.named_modules():
        if isinstance(m, QuantEmbedding):
            entries[fqn] = {
                "module": "embedding", "format": m.fmt.to_json(), "layout": m.layout.name,
                "layout_version": m.layout.version, "num_embeddings": m.num_embeddings,
                "embedding_dim": m.embedding_dim, "padding_idx": m.padding_idx,
                "out_dtype": str(m.out_dtype).removeprefix("torch."), "scale": m.scale,
            }
        if not isinstance(m, QuantLinear):
            continue
        entries[fqn] = {
            "format": m.fmt.to_json(), "layout": m.layout.name, "layout_version": m.layout.version,
            "in_features": m.in_features, "out_features": m.out_features,
            "bias": m.bias is not None, "bias_dtype": str(m.bias.dtype).removeprefix("torch.") if m.bias is not None else None,
            "split_sizes": m.split_sizes, "fused_from": fused_parents.get(fqn),
        }
    return entries


def _runtime_buffer_names(model: nn.Module) -> set[str]:
    names = set()
    for fqn, m in model.named_modules():
        if isinstance(m, QuantLinear):
            names.update(f"{fqn}.{n}" for n in m._kernel_buffer_names if n not in m._buffer_names)
    return names


def save_quantized(model: nn.Module, path: Union[str, os.PathLike]) -> None:
    """Writes every parameter and buffer of a quantized model (quantized or not) to one file, with
    its activation quantization (ActQuantLinear settings) and KV-cache setting in the metadata."""
    act_quant = unwrap_activation_quant(model)
    try:
        _save(model, path, act_quant)
    finally:
        wrap_activation_quant(model, act_quant)


def _save(model: nn.Module, path: Union[str, os.PathLike], act_quant: dict) -> None:
    tensors: dict[str, Tensor] = dict(model.state_dict())
    persistent = set(tensors)
    derived = _runtime_buffer_names(model)
    for name, buf in model.named_buffers():
        if name not in persistent and name not in derived:
            tensors[_NONPERSISTENT + name] = buf  # e.g. rotary tables: needed for meta skeletons
    unique: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in tensors.items():
        if t.device.type == "meta":
            raise ValueError(f"save_quantized: {name} is on the meta device; load real weights first")
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype) \
            if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]  # tied weights (e.g. lm_head = embed_tokens) are stored once
            continue
        if key is not None:
            seen[key] = name
        unique[name] = t.detach().contiguous().cpu()
    from ..version import __version__
    meta = {"checkpoint_version": CHECKPOINT_VERSION, "torch_lowbit_version": __version__,
            "modules": module_entries(model), "aliases": aliases, "online_hadamard": online_hadamard_modules(model),
            "act_quant": act_quant, "kv_cache": kv_cache_config(model),
            "crc32": {n: _crc(t) for n, t in unique.items()}}
    save_file(unique, os.fspath(path), metadata={_META_KEY: json.dumps(meta)})


def _read(path: str) -> tuple[dict, dict[str, Tensor]]:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with safe_open(path, framework="pt") as f:
            header = f.metadata() or {}
            if _META_KEY not in header:
                raise CheckpointError(f"{path} is a safetensors file but not a torch_lowbit checkpoint (no "
                                      f"'{_META_KEY}' metadata); write it with torch_lowbit.save_quantized")
            meta = json.loads(header[_META_KEY])
            version = meta.get("checkpoint_version")
            if version != CHECKPOINT_VERSION:
                raise CheckpointError(
                    f"{path} is a torch_lowbit checkpoint of version {version}; this torch_lowbit "
                    f"{_pkg_version()} reads version {CHECKPOINT_VERSION}. Install the torch_lowbit that wrote "
                    f"it ({meta.get('torch_lowbit_version')}) or re-quantize the float model and save again")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises on truncated headers / data and bad JSON
        raise CheckpointError(f"{path} is corrupt or truncated and cannot be read ({type(e).__name__}: {e}); "
                              "re-save it with torch_lowbit.save_quantized") from e
    crcs = meta.get("crc32", {})
    for name, t in tensors.items():
        if name not in crcs or _crc(t) != crcs[name]:
            raise CheckpointError(f"{path}: tensor {name} fails its checksum (the file is corrupt); "
                                  "re-save it with torch_lowbit.save_quantized")
    missing = set(crcs) - set(tensors)
    if missing:
        raise CheckpointError(f"{path}: tensors listed in the metadata are missing: {sorted(missing)[:5]}")
    return meta, tensors


def _pkg_version() -> str:
    from ..version import __version__
    return __version__


def online_hadamard_modules(model: nn.Module) -> list[str]:
    """Names of the layers a QuaRot rotation (rotate_) wrapped in an online Hadamard."""
    return [name for name, m in model.named_modules() if isinstance(m, OnlineHadamardLinear)]


def install_online_hadamards(model: nn.Module, names: list[str], path: str) -> None:
    """Gives an unrotated skeleton the structure rotate_ gave the saved model (its weights come from
    the file): the named Linear layers wrapped in OnlineHadamardLinear, the head untied."""
    for fqn in names:
        pfqn, _, child = fqn.rpartition(".")
        try:
            parent = model.get_submodule(pfqn) if pfqn else model
        except AttributeError as err:
            raise CheckpointError(f"{path}: the model has no module {pfqn!r}; wrong skeleton") from err
        old = getattr(parent, child, None)
        if isinstance(old, OnlineHadamardLinear):
            continue
        if not isinstance(old, nn.Linear):
            raise CheckpointError(f"{path}: {fqn} was saved rotated (online Hadamard) but the model has "
                                  f"{type(old).__name__} there; wrong skeleton")
        setattr(parent, child, OnlineHadamardLinear(old, old.in_features))
    if names and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # rotate_ unties the head: the file holds both


def install_shells(model: nn.Module, modules: dict[str, dict], path: str) -> None:
    """Replaces the model's Linear layers named in `modules` (module_entries of the saved model) by
    empty QuantLinear modules of the saved format, layout and shapes (meta device), fused where they
    were; loading then assigns their buffers. `path` names the source in errors."""
    for fqn, e in modules.items():
        try:
            fmt = format_from_json(e["format"])
            layout = get_layout(e["layout"])
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{path}: module {fqn} cannot be rebuilt: {err}") from err
        if layout.version != e["layout_version"]:
            raise CheckpointError(f"{path}: module {fqn} uses layout {layout.name} v{e['layout_version']}, this "
                                  f"torch_lowbit has v{layout.version}; re-quantize and save again")
        pfqn, _, child = fqn.rpartition(".")
        try:
            parent = model.get_submodule(pfqn) if pfqn else model
        except AttributeError as err:
            raise CheckpointError(f"{path}: the model has no module {pfqn!r}; load into a skeleton of the "
                                  "architecture that was saved") from err
        if e.get("module") == "embedding":
            old = getattr(parent, child, None)
            size = (getattr(old, "num_embeddings", None), getattr(old, "embedding_dim", None))
            if not isinstance(old, (nn.Embedding, QuantEmbedding)) or size != (e["num_embeddings"], e["embedding_dim"]):
                raise CheckpointError(f"{path}: {fqn} in the model is {type(old).__name__}, not an Embedding of "
                                      f"{e['num_embeddings']}x{e['embedding_dim']}; wrong skeleton")
            setattr(parent, child, QuantEmbedding.empty(e["num_embeddings"], e["embedding_dim"], fmt, layout=layout,
                                                        padding_idx=e["padding_idx"],
                                                        out_dtype=getattr(torch, e["out_dtype"]),
                                                        scale=float(e.get("scale", 1.0))))
            continue
        shell = QuantLinear.empty(e["in_features"], e["out_features"], fmt, bias=e["bias"],
                                  bias_dtype=getattr(torch, e["bias_dtype"]) if e["bias"] else torch.float32,
                                  layout=layout, split_sizes=e["split_sizes"])
        if e["fused_from"]:
            originals = [getattr(parent, n, None) for n in e["fused_from"]]
            sizes = [getattr(o, "out_features", None) for o in originals]
            if not all(isinstance(o, (nn.Linear, ProjectionSlot)) for o in originals) or sizes != e["split_sizes"]:
                raise CheckpointError(f"{path}: {pfqn} has no projections {e['fused_from']} of sizes "
                                      f"{e['split_sizes']}; load into a skeleton of the saved architecture")
            install_fused(parent, tuple(e["fused_from"]), child, shell)
        else:
            old = getattr(parent, child, None)
            if not isinstance(old, (nn.Linear, QuantLinear)) or (old.in_features, old.out_features) != (
                    e["in_features"], e["out_features"]):
                raise CheckpointError(f"{path}: {fqn} in the model is {type(old).__name__}, not a Linear of "
                                      f"{e['in_features']}->{e['out_features']}; wrong skeleton")
            setattr(parent, child, shell)


def load_quantized(model: nn.Module, path: Union[str, os.PathLike], *,
                   device: Optional[Union[str, torch.device]] = None) -> nn.Module:
    """Loads a save_quantized checkpoint into `model`, a float or meta-device skeleton of the same
    architecture (e.g. built with `with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)`).
    Its Linear layers are replaced by the saved QuantLinear modules; returns the model."""
    path = os.fspath(path)
    meta, tensors = _read(path)
    install_online_hadamards(model, meta.get("online_hadamard", []), path)
    install_shells(model, meta["modules"], path)
    for alias, canonical in meta.get("aliases", {}).items():
        tensors[alias] = tensors[canonical]
    state = {k: v for k, v in tensors.items() if not k.startswith(_NONPERSISTENT)}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise CheckpointError(f"{path} does not match this model: {err}") from err
    for key, t in tensors.items():
        if key.startswith(_NONPERSISTENT):
            mfqn, _, bname = key[len(_NONPERSISTENT):].rpartition(".")
            owner = model.get_submodule(mfqn) if mfqn else model
            owner.register_buffer(bname, t, persistent=False)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise CheckpointError(f"{path}: tensors still on the meta device after loading: {left[:5]}")
    if hasattr(model, "tie_weights") and meta.get("aliases"):
        try:
            model.tie_weights()
        except Exception:  # the aliasing above already shares the storage
            pass
    repack_for_this_cpu(model)  # a checkpoint packed for another CPU (x86 tiles, ARM interleavings)
    try:
        wrap_activation_quant(model, meta.get("act_quant") or {})
    except (AttributeError, KeyError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path}: its activation-quantization entries do not fit this model ({err})") from err
    if meta.get("kv_cache") and hasattr(model, "config"):
        set_kv_cache_config(model, meta["kv_cache"])
    if device is not None:
        model.to(device)
    return model
