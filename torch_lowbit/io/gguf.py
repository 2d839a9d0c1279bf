"""GGUF import: a llama.cpp model file -> a Hugging Face model whose Linear layers are QuantLinear
modules holding the file's own blocks (Q4_0 -> q4_0, Q4_1 -> int4_g32, IQ4_NL -> iq4_nl, Q8_0 -> q8_0
where that format is registered), decoded byte for byte, never requantized. Other tensor types are
dequantized to float (or, with requantize=, quantized to a named format), one log line per tensor.

The file is parsed once (one gguf.GGUFReader): the config is transformers' GGUF metadata mapping
applied to that reader's fields, the tokenizer transformers' conversion, cached as JSON after a file's
first import (io.tokenizer_cache); the weights never go through transformers' loader (which
dequantizes everything). Export: gguf_export.to_gguf.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch
from torch import Tensor, nn

from ..core.packing import row_bytes
from ..formats import Format, get_format
from ..layouts import Layout, default_layout, get_layout
from ..nn.fusion import fusion_jobs, install_fused, job_members
from ..nn.embedding import QuantEmbedding, embedding_scale
from ..nn.linear import QuantLinear
from .gguf_arch import ARCHS
from .gguf_blocks import block_tensors, codes_as_row_bytes, native_format, rope_rows
from .gguf_kquants import kquant_format, kquant_tensors
from .gguf_summary import DEQUANTIZED, KEPT, REQUANTIZED, ImportSummary, readable_type
from .tokenizer_cache import cached_tokenizer

log = logging.getLogger(__name__)



class GGUFError(ValueError):
    """A GGUF file that cannot be imported: not GGUF, truncated, unsupported architecture, missing tensors."""


def require_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("GGUF import/export needs the gguf package: pip install 'torch_lowbit[eval]' "
                          "(or pip install gguf transformers accelerate)") from e
    return gguf


def tensor_name_map(arch: str, n_layers: int):
    """gguf's HF-module -> GGUF-tensor name map of an architecture (get_name(fqn + '.weight'))."""
    gguf = require_gguf()
    enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(enum, n_layers)


def gguf_name(name_map, hf_name: str) -> Optional[str]:
    return name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))


def qk_heads(gguf_tensor_name: str, config, arch: str) -> Optional[int]:
    """The head count of llama.cpp's row permutation of this tensor (attn_q / attn_k of an
    architecture whose converter permutes them), else None."""
    if not ARCHS[arch].permute_qk:
        return None
    if ".attn_q." in gguf_tensor_name:
        return config.num_attention_heads
    if ".attn_k." in gguf_tensor_name:
        return config.num_key_value_heads
    return None


def resolve_layout(layout: Union[None, str, Layout], fmt: Format) -> Layout:
    if layout is None:
        return default_layout(fmt, "cpu")
    layout = get_layout(layout) if isinstance(layout, str) else layout
    if not layout.supports(fmt):
        raise ValueError(f"layout {layout.name} cannot hold format {fmt.name} (this GGUF has {fmt.name} "
                         f"tensors); pass layout=None for each format's CPU default")
    return layout


LEAN_ARRAY_MIN = 1024  # a lean reader leaves arrays of this many values or more unparsed


@functools.lru_cache(maxsize=None)
def _reader_class(lean: bool = False):
    """gguf.GGUFReader over a plain ndarray view of its memory map (still mapped, nothing read): the
    reader slices the map once per value, 200k times for a 49k-entry vocabulary and its merges, and
    each numpy.memmap slice runs memmap's Python-level __array_finalize__ (SmolLM2: 2.3 s -> 0.7 s).
    lean: arrays of LEAN_ARRAY_MIN values or more (the vocabulary, its merges, scores and token types)
    are stepped over, not parsed: such a field keeps only its item type and length (array_length),
    contents() is empty. gguf-py holds 2-3 numpy views a value, ~73 MB for SmolLM2's 49k vocabulary,
    which from_gguf never reads (transformers reads the file's tokenizer itself)."""
    gguf = require_gguf()

    class PlainArrayReader(gguf.GGUFReader):
        def __setattr__(self, name, value):
            if name == "data" and isinstance(value, np.memmap):
                value = value.view(np.ndarray)
            super().__setattr__(name, value)

        def _get_field_parts(self, orig_offs, raw_type):
            if lean and raw_type == gguf.GGUFValueType.ARRAY:
                item, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
                size = _array_bytes(self.data, orig_offs + 12, int(item[0]), int(count[0]), self.gguf_scalar_to_np,
                                    gguf.GGUFValueType)
                if size is not None:
                    return 12 + size, [item, count], [], [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(int(item[0]))]
            return super()._get_field_parts(orig_offs, raw_type)
    return PlainArrayReader


def _array_bytes(data: np.ndarray, offs: int, item: int, count: int, scalars: dict, types) -> Optional[int]:
    """Bytes of a GGUF array's values at offs (strings: each an 8-byte length and its bytes), or None to
    parse it (short arrays, arrays of arrays)."""
    if count < LEAN_ARRAY_MIN:
        return None
    if item == types.STRING:
        start = offs
        for _ in range(count):
            offs += 8 + int.from_bytes(data[offs:offs + 8].tobytes(), "little")
        return offs - start
    scalar = scalars.get(types(item))
    return None if scalar is None else count * np.dtype(scalar).itemsize


def array_length(field) -> int:
    """The number of values of a GGUF array field, parsed or stepped over by a lean reader (its parts
    begin key length, key, value type, item type, count)."""
    return int(field.parts[4][0])


def open_gguf(path: Union[str, os.PathLike], *, lean: bool = False):
    """A gguf.GGUFReader of path, or a GGUFError saying why the file is not a readable GGUF. lean: long
    arrays are not parsed (see _reader_class): what from_gguf needs."""
    reader_class = _reader_class(lean)  # without the gguf package: ImportError, not a GGUFError
    path = Path(os.fspath(path))
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        reader = reader_class(path)
    except Exception as e:  # bad magic, truncated header or tensor data: numpy / struct errors
        raise GGUFError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); pass a complete "
                        "llama.cpp .gguf model file") from e
    return reader


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def gguf_architecture(reader, path) -> str:
    """The file's general.architecture, or a GGUFError naming the ones from_gguf supports."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{path} holds a {arch!r} model; from_gguf supports the architectures "
                        f"{', '.join(sorted(ARCHS))} (Mistral GGUFs are 'llama')")
    return arch


# ---- reading one tensor ----------------------------------------------------------------------------

def _float_weight(t, config, arch: str) -> Tensor:
    """fp32 HF-ordered weight of any GGUF tensor type (gguf's own dequantizer)."""
    gguf = require_gguf()
    w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    if ARCHS[arch].norm_offset and ARCHS[arch].is_norm(t.name):
        w = w - ARCHS[arch].norm_offset  # the file stores Gemma's (1 + w) norm weights as 1 + w
    heads = qk_heads(t.name, config, arch)
    if heads is not None:
        w = w[rope_rows(w.shape[0], heads, to_gguf=False)]
    return w


@contextlib.contextmanager
def _torch_on_one_thread() -> Iterator[None]:
    """torch's ops on the calling thread, for moving block bytes: many small memory-bound ops, for which
    waking and joining torch's OpenMP threads costs more than the work, and a thread on a busy core
    stalls every op (SmolLM2's blocks on 2 cores: 0.3 s on one thread, 1.8 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def kept_format(type_name: str, requantize: Optional[Format] = None) -> Optional[str]:
    """The format whose blocks a linear GGUF tensor of this type is kept in (None: dequantized or
    requantized): the 32-weight block types always; the K-quants unless requantize= asks for another
    format."""
    native = native_format(type_name)
    if native is not None:
        return native
    return kquant_format(type_name) if requantize is None else None


def _native_q(t, config, arch: str) -> dict[str, Tensor]:
    """The tensor's blocks as its format's tensors, rows in HF order: scales (/ mins) and codes as row
    bytes for the 32-weight block types (block_tensors), the unpacked K-quant tensors for K-quants."""
    with _torch_on_one_thread():
        kquant = kquant_format(t.tensor_type.name) is not None
        q = kquant_tensors(t.data, t.tensor_type.name) if kquant else block_tensors(t.data, t.tensor_type.name)
        heads = qk_heads(t.name, config, arch)
        if heads is not None:
            idx = rope_rows(q["codes"].shape[0], heads, to_gguf=False)
            q = {k: v[idx] for k, v in q.items()}
    return q


def _plan_format(t, fqn: str, requantize: Optional[Format], is_head: bool, notes: list) -> Optional[Format]:
    """The format a Linear layer's GGUF tensor becomes (None: float); a line for `notes` (logged after
    the import summary) if not native."""
    kept = kept_format(t.tensor_type.name, requantize if not is_head else None)
    if kept is not None:
        return get_format(kept)
    kind = t.tensor_type.name
    rows, cols = int(t.shape[1]) if len(t.shape) > 1 else 1, int(t.shape[0])
    if requantize is not None and not is_head:
        problem = requantize.shape_problem(rows, cols)
        if problem is None:
            notes.append((logging.INFO, f"{t.name}: GGUF {kind} is not a torch_lowbit format; dequantized and "
                                        f"requantized to {requantize.name} (lossy)"))
            return requantize
        notes.append((logging.WARNING, f"{t.name}: GGUF {kind} kept in float: {requantize.name} {problem}"))
        return None
    why = " (the q8_0 format is not in this torch_lowbit)" if kind == "Q8_0" else ""
    notes.append((logging.INFO, f"{t.name}: GGUF {kind}{why} dequantized to float ({fqn})"))
    return None


# ---- from_gguf -------------------------------------------------------------------------------------

def from_gguf(path: Union[str, os.PathLike], *, dtype: torch.dtype = torch.float32,
              requantize: Union[None, str, Format] = None, layout: Union[None, str, Layout] = None,
              fuse: bool = True, quantized_embedding: bool = True, tokenizer: bool = True):
    """(model, tokenizer) from a llama.cpp GGUF file (architectures llama (incl. Mistral), qwen2, qwen3, phi3,
    gemma2, gemma3 (its text backbone); io/gguf_arch.py).

    Linear weights stored as Q4_0 / Q4_1 / IQ4_NL / Q8_0 become QuantLinear modules in q4_0 / int4_g32 /
    iq4_nl / q8_0 holding exactly the file's blocks (their dequantize() equals gguf.quants.dequantize
    of the tensor, bit for bit). A token embedding in one of those types becomes a QuantEmbedding of
    its blocks (quantized_embedding=False: float), and a head tied to it shares its packed buffers,
    as llama.cpp runs SmolLM2's Q8_0 embedding/head. Every other tensor is
    dequantized to `dtype`; requantize="FORMAT" quantizes the other Linear weights (not the LM head)
    to that format instead. layout: one layout for every QuantLinear (default: each format's CPU
    default). fuse: q/k/v and gate/up of one block become one QuantLinear where they share a format
    (rows concatenated: lossless). The tokenizer returned is None when the file has no tokenizer
    metadata, or with tokenizer=False (transformers' conversion of a GGUF vocabulary takes seconds on a
    file's first import; later imports load it from the tokenizer cache).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    requantize = get_format(requantize) if requantize is not None else None
    if layout is not None and not isinstance(layout, (str, Layout)):
        raise TypeError(f"layout must be a layout name or a Layout, got {type(layout).__name__}")
    path = Path(os.fspath(path))
    reader = open_gguf(path, lean=True)
    arch = gguf_architecture(reader, path)
    config, model = _skeleton(reader, arch, path, dtype)
    # the tokenizer before the weights: its load's transient memory (JSON, transformers' conversion on a
    # first import) then adds to the file's header, not to the converted weights
    tok = gguf_tokenizer(reader, path) if tokenizer else None
    _return_freed_heap()
    name_map = tensor_name_map(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    used: set[str] = set()

    def tensor_of(hf_name: str, required: bool = True):
        name = gguf_name(name_map, hf_name)
        if name is None or name not in tensors:
            if required:
                raise GGUFError(f"{path} has no tensor for {hf_name} (GGUF name {name}); the file does not "
                                f"match its {arch} metadata")
            return None
        used.add(name)
        return tensors[name]

    head = model.get_output_embeddings()
    head_fqn = next((n for n, m in model.named_modules() if m is head), None)
    tied = bool(getattr(config, "tie_word_embeddings", False)) and tensor_of(f"{head_fqn}.weight", False) is None
    embed_fqn = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())

    embed_t = tensor_of(f"{embed_fqn}.weight")
    embed_kept = quantized_embedding and kept_format(embed_t.tensor_type.name) is not None
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)
               and not (embed_kept and tied and fqn == head_fqn)}
    sources = {fqn: tensor_of(f"{embed_fqn if tied and fqn == head_fqn else fqn}.weight") for fqn in linears}
    notes: list = []
    plan = {fqn: _plan_format(t, fqn, requantize, fqn == head_fqn, notes) for fqn, t in sources.items()}
    layouts = {fqn: resolve_layout(layout, f) for fqn, f in plan.items() if f is not None}
    kept = {fqn: f is not None and f.name == kept_format(sources[fqn].tensor_type.name,
                                                         requantize if fqn != head_fqn else None)
            for fqn, f in plan.items()}  # the file's blocks as they are (else requantized or float)
    _announce(path, reader, dtype, sources, plan, kept, embed_t, embed_kept, shared_head=head_fqn if tied else None)
    for level, note in notes:
        log.log(level, "%s", note)

    qemb = _quantized_embedding(embed_t, model, config, arch, dtype, layout) if embed_kept else None
    _drop_pages(reader, [embed_t] if qemb is not None else [])
    _return_freed_heap()
    if qemb is not None:
        _set_child(model, embed_fqn, qemb)
    targets = [fqn for fqn, f in plan.items() if f is not None]
    jobs = fusion_jobs(model, targets, fuse, may_fuse=lambda fqns: len({plan[f] for f in fqns}) == 1)

    converted = 0  # file bytes converted since the freed heap was last returned
    for job in jobs:
        members = job_members(job)
        fmt, lay = plan[members[0]], layouts[members[0]]
        native = [kept[fqn] and native_format(sources[fqn].tensor_type.name) is not None
                  and codes_as_row_bytes(sources[fqn].tensor_type.name) for fqn in members]  # codes as row bytes
        qs, biases = [], []
        for fqn in members:
            is_kept = kept[fqn]
            t = sources[fqn]
            if is_kept:
                qs.append(_native_q(t, config, arch))
            else:  # requantized; beside native blocks (fused with them) its codes take their byte form
                qr = fmt.quantize(_float_weight(t, config, arch))
                qs.append({**qr, "codes": row_bytes(qr["codes"], fmt.code_bits)} if any(native) else qr)
            b = tensor_of(f"{fqn}.bias", False) if fqn != head_fqn or not tied else None
            biases.append(_float_weight(b, config, arch).to(dtype) if b is not None else None)
        sizes = [p["codes"].shape[0] for p in qs]
        pfqn, names, fused_name = job
        in_features = int(sources[members[0]].shape[0])  # ggml's shape: [K, N]
        with _torch_on_one_thread():  # concatenating and packing: byte moves
            q = {k: torch.cat([p[k] for p in qs]) for k in qs[0]}
            bias = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else torch.zeros(n, dtype=dtype) for b, n in zip(biases, sizes)])
            module = QuantLinear.from_quantized(fmt, q, sum(sizes), in_features, bias=bias, layout=lay,
                                                split_sizes=sizes if fused_name is not None else None,
                                                codes_as_row_bytes=any(native))
        if fused_name is None:
            _set_child(model, pfqn, module)
        else:
            install_fused(model.get_submodule(pfqn) if pfqn else model, tuple(names), fused_name, module)
        _drop_pages(reader, [sources[fqn] for fqn in members])
        converted += sum(int(sources[fqn].n_bytes) for fqn in members)
        if converted >= TRIM_EVERY_BYTES:
            _return_freed_heap()
            converted = 0

    _return_freed_heap()
    if qemb is not None and tied:
        _set_child(model, head_fqn, qemb.tied_head())
    state = {}
    skip = {f"{fqn}.weight" for fqn in targets} | {f"{fqn}.bias" for fqn in targets}
    for hf_name, t in model.state_dict(keep_vars=True).items():
        if hf_name in skip or t.device.type != "meta":
            continue  # QuantLinear buffers are filled; real buffers (rotary tables) are computed
        if tied and hf_name == f"{head_fqn}.weight":
            continue
        src = tensor_of(hf_name)
        w = _float_weight(src, config, arch).reshape(t.shape).to(dtype)
        if src.tensor_type.name not in ("F32", "F16", "BF16") or w.dim() > 1:
            log.info("%s: GGUF %s -> %s %s", src.name, src.tensor_type.name, str(dtype).removeprefix("torch."),
                     hf_name)
        state[hf_name] = w
    model.load_state_dict(state, strict=False, assign=True)
    if tied and not isinstance(model.get_output_embeddings(), QuantLinear) and qemb is None:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise GGUFError(f"{path}: no GGUF tensor filled {left[:5]}; the file does not match its metadata")
    ignored = sorted(set(tensors) - used)
    if ignored:
        log.warning("%s: %d GGUF tensor(s) have no place in the %s model and were ignored: %s", path.name,
                    len(ignored), type(model).__name__, ", ".join(ignored[:5]))
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            counts[f"{m.fmt.name}/{m.layout.name}"] = counts.get(f"{m.fmt.name}/{m.layout.name}", 0) + 1
    log.info("from_gguf %s: %s QuantLinear module(s) %s", path.name, sum(counts.values()), counts)
    return model.eval(), tok


def _announce(path: Path, reader, dtype: torch.dtype, sources: dict, plan: dict, kept: dict, embed_t,
              embed_kept: bool, shared_head: Optional[str]) -> None:
    """Refuses tensors no dequantizer here reads, then logs the import summary (io.gguf_summary) before
    any weight is read."""
    unreadable = sorted({f"{t.name} ({t.tensor_type.name})" for t in reader.tensors if not readable_type(t.tensor_type)})
    if unreadable:
        raise GGUFError(f"{path}: tensor type(s) that neither torch_lowbit nor gguf can read: {', '.join(unreadable[:5])}; "
                        "convert the file with llama.cpp's llama-quantize to a common type (e.g. Q4_K_M or Q8_0)")
    summary = ImportSummary(path.name, path.stat().st_size, dtype)
    counted = set()
    for fqn, t in sources.items():
        fmt = plan[fqn]
        if fqn == shared_head and fmt is None:
            continue  # a float head tied to the embedding shares its weight
        if fmt is None:
            summary.add(t, DEQUANTIZED)
        elif kept[fqn]:
            summary.add(t, KEPT, fmt.name)
        else:
            summary.add(t, REQUANTIZED, fmt.name, fmt.bits_per_weight())
        counted.add(t.name)
    for t in reader.tensors:
        if t.name in counted:
            continue
        if t is embed_t and embed_kept:
            summary.add(t, KEPT, kept_format(t.tensor_type.name))
        else:
            summary.add(t, DEQUANTIZED)
    fix = summary.fix()
    if fix:
        log.warning("%s. %s", summary.line(), fix)
    else:
        log.info("%s", summary.line())


def _quantized_embedding(t, model: nn.Module, config, arch: str, dtype: torch.dtype,
                         layout: Union[None, str, Layout]) -> Optional[QuantEmbedding]:
    """The token embedding as a QuantEmbedding of the file's own blocks (K-quants included), or None if its
    type has no torch_lowbit format (then it is dequantized like any float tensor)."""
    native = kept_format(t.tensor_type.name)
    if native is None:
        return None
    fmt, old = get_format(native), model.get_input_embeddings()
    log.info("%s: GGUF %s kept as %s blocks (QuantEmbedding; rows dequantized as they are looked up)",
             t.name, t.tensor_type.name, fmt.name)
    q = _native_q(t, config, arch)
    with _torch_on_one_thread():
        return QuantEmbedding.from_quantized(fmt, q, old.num_embeddings, old.embedding_dim,
                                             layout=resolve_layout(layout, fmt), padding_idx=old.padding_idx,
                                             out_dtype=dtype, codes_as_row_bytes=native_format(t.tensor_type.name) is not None
                                             and codes_as_row_bytes(t.tensor_type.name),
                                             scale=embedding_scale(old))


def _drop_pages(reader, tensors) -> None:
    """Drops these tensors' file pages from the process (they stay in the OS page cache; a later read
    faults them back): once a tensor is converted the import no longer holds its bytes twice, so its
    peak memory is the model plus about one tensor, not the model plus the whole mapped file."""
    mm, a = None, reader.data  # an ndarray view of the reader's numpy.memmap (open_gguf): its base chain
    while a is not None and mm is None:
        mm, a = (a, None) if isinstance(a, mmap.mmap) else (getattr(a, "_mmap", None), getattr(a, "base", None))
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return  # another platform or numpy: the pages stay until the reader goes
    page = mmap.PAGESIZE
    for t in tensors:
        if t is None:
            continue
        start = int(t.data_offset) // page * page
        end = min(len(mm), -(-(int(t.data_offset) + int(t.n_bytes)) // page) * page)
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)


TRIM_EVERY_BYTES = 16 << 20  # the freed heap goes back to the OS after each this many converted file bytes


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library or platform)."""
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _return_freed_heap() -> None:
    """Hands the heap memory freed so far back to the OS. glibc keeps the freed temporaries of each
    tensor's conversion (unpacking, packing, several threads' arenas) inside the process, so without
    this the import's peak RSS varied by ~35 MB between identical runs (SmolLM2 Q4_K_M: 146-187 MB over
    the baseline). A call walks the heap and the next allocations fault pages back in (~15 ms each on
    SmolLM2; after every tensor it added 0.5 s to a 1-s import), hence every TRIM_EVERY_BYTES."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _set_child(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def gguf_config_dict(reader, arch: str) -> dict:
    """The config dict transformers' load_gguf_checkpoint builds from a file's metadata (its key map and
    defaults, for the architectures from_gguf supports), read from this reader's fields: transformers
    would parse the whole file again, its 49k-entry vocabulary included."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    # transformers' test is `"mistral" in [general.name]`: only a file named exactly "mistral" is one
    model_type = "mistral" if arch == "llama" and _field(reader, "general.name") == "mistral" else arch
    built_type = ARCHS[arch].hf_model_type or model_type
    config = {"tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors)}
    config.update(GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}))
    for key, field in reader.fields.items():
        prefix, _, rest = key.replace(arch, model_type).partition(".")
        name = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if name is None or name == -1:
            continue
        value = field.contents()
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        config[name] = value.replace(arch, model_type) if isinstance(value, str) else value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in reader.fields:
        config["vocab_size"] = array_length(reader.fields["tokenizer.ggml.tokens"])
    config["model_type"] = built_type  # as transformers renames it (gemma3: the text backbone)
    return config


def _skeleton(reader, arch: str, path: Path, dtype: torch.dtype):
    """(config, model with parameters on the meta device and real buffers) of the GGUF's metadata."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    try:
        config_dict = gguf_config_dict(reader, arch)
        config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
        config._name_or_path = str(path.parent)  # as AutoConfig.from_pretrained(folder, gguf_file=) sets it
    except Exception as e:
        raise GGUFError(f"{path}: transformers cannot build a config from this GGUF's metadata "
                        f"({type(e).__name__}: {e})") from e
    head_dim = _field(reader, f"{arch}.attention.key_length")  # transformers does not read it for every arch
    if head_dim is not None:
        config.head_dim = int(head_dim)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return config, model


def gguf_tokenizer(reader, path: Path):
    """transformers' tokenizer from the file's tokenizer.* keys (converted on a file's first import,
    then loaded from the tokenizer cache: io.tokenizer_cache); None when it has none."""
    if "tokenizer.ggml.model" not in reader.fields:
        log.info("%s has no tokenizer metadata: no tokenizer returned", path.name)
        return None
    from transformers import AutoTokenizer
    return cached_tokenizer(path, lambda: AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
