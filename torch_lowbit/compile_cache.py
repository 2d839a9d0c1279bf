"""Compile once: a generation step compiled by torch.compile (fullgraph) is saved to a per-user cache
and loaded by the next process with the same model structure and shapes, which then skips Dynamo's
tracing, AOTAutograd and inductor (docs/generation.md#compile-once).

The artifact is torch's precompile (`torch.compile(fn).aot_compile(...)`): Dynamo's bytecode, its
guards and inductor's generated code, serialized with pickle. Loading unpickles, so an artifact is
only read from a cache directory this module created (owned by the user, mode 0700) and only when
its HMAC, made with the user's secret key (mode 0600 in the default cache folder, whichever folder
holds the artifacts), matches: a file this library did not write for this user (copied from elsewhere,
truncated, corrupt) is rebuilt, never unpickled.

File layout: MAGIC, one line of JSON header (the key fields and the traced sources' checksums,
checked before anything is unpickled), the 32-byte HMAC-SHA256 of header + payload, the payload.
"""
from __future__ import annotations

import hashlib
import hmac
import importlib
import inspect
import json
import logging
import os
import platform
import secrets
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from .core.cache import cache_dir
from .version import __version__

log = logging.getLogger(__name__)

MAGIC = b"torch_lowbit compiled step v1\n"
_KEY_FILE = "signing-key"
_PACKAGE_DIR = Path(__file__).resolve().parent


def default_directory() -> Path:
    """Where compiled steps go unless a generator names another folder: <cache>/compiled, with
    <cache> = $TORCH_LOWBIT_CACHE or ~/.cache/torch_lowbit."""
    return cache_dir() / "compiled"


def open_directory(directory: Optional[os.PathLike | str] = None) -> Path:
    """The cache folder, created with mode 0700. PermissionError when another user owns it or others
    may write to it: its artifacts are unpickled, so nobody else may be able to plant one."""
    path = Path(directory) if directory is not None else default_directory()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise PermissionError(f"compile cache folder {path} belongs to another user; choose a folder of yours "
                              "(CompiledGenerator(compile_cache_dir=...)) or compile_cache=False")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"compile cache folder {path} is writable by other users; `chmod 700 {path}` "
                              "or choose another folder (CompiledGenerator(compile_cache_dir=...))")
    return path


def _signing_key() -> bytes:
    """The user's secret (32 random bytes, mode 0600, in the default folder even when artifacts go to
    another: a folder someone hands over cannot bring its own key), made by the first process that needs it."""
    directory = open_directory()
    key_path = directory / _KEY_FILE
    if not key_path.exists():
        # written whole to a temp file (mkstemp: mode 0600), then linked into place, which fails if a
        # concurrent process got there first: nobody reads a half-written key
        fd, tmp = tempfile.mkstemp(dir=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(tmp, key_path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    key = key_path.read_bytes()
    if len(key) != 32:
        raise PermissionError(f"{key_path} is not a torch_lowbit signing key; delete it (the cache is rebuilt)")
    return key


# ---------------------------------------------------------------------------------------------
# The key: everything that changes the compiled code


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _describe(value: Any, depth: int = 0) -> Any:
    """A JSON-able description of what compiled code may depend on: scalars by value, tensors by
    shape/stride/dtype/device (never their values: weights are graph inputs), objects by type and
    their attributes (two levels deep), functions by name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return str(value)
    if isinstance(value, Tensor):
        return ["tensor", list(value.shape), list(value.stride()), str(value.dtype), str(value.device)]
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_describe(v, depth) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        return {str(k): _describe(v, depth) for k, v in value.items()}
    if inspect.isroutine(value) or inspect.isclass(value):
        return _name(value)
    if depth < 2 and hasattr(value, "__dict__"):
        return {"type": _name(type(value)), **{k: _describe(v, depth + 1) for k, v in vars(value).items()}}
    return _name(type(value))


# described separately (parameters, buffers, submodules, config) or never read by forward
# (generation_config, whose recorded hash changes with PYTHONHASHSEED)
_NOT_DESCRIBED = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "config", "generation_config"}


def describe_model(model: nn.Module) -> dict:
    """Structure, config, formats and layouts of a model (each module's type, plain attributes, hooks,
    parameter and buffer shapes/dtypes), not its weight values."""
    modules = {}
    for name, mod in model.named_modules():
        # hook dicts by their functions in order (their keys are handle ids, which differ per process)
        attrs = {k: _describe(list(v.values()) if "hooks" in k and isinstance(v, dict) else v)
                 for k, v in vars(mod).items() if k not in _NOT_DESCRIBED}
        tensors = {k: _describe(t) for k, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]}
        modules[name] = {"type": _name(type(mod)), "attrs": attrs, "tensors": tensors}
    config = getattr(model, "config", None)
    return {"modules": modules, "config": _describe(config.to_dict()) if config is not None else None}


def _package_fingerprint() -> str:
    """sha256 of torch_lowbit's Python sources (fake impls, layouts and generation code shape the
    graph) and of its registered op schemas."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE_DIR.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE_DIR)).encode())
        h.update(path.read_bytes())
    for schema in sorted(str(s) for s in torch._C._jit_get_all_schemas() if s.name.startswith("torch_lowbit::")):
        h.update(schema.encode())
    return h.hexdigest()


def _cpu_facts() -> dict:
    """The CPU and the kernel path in use: inductor's generated C++ and torch_lowbit's ops depend on both."""
    from .ops import cpu_model
    facts = {"cpu": cpu_model(), "machine": platform.machine(), "aten_capability": torch.backends.cpu.get_cpu_capability(),
             "TORCH_LOWBIT_CPU_MAX_PATH": os.environ.get("TORCH_LOWBIT_CPU_MAX_PATH"),
             "TORCH_LOWBIT_CPU_PATH": os.environ.get("TORCH_LOWBIT_CPU_PATH")}
    try:
        from .ops import cpu_extension
        facts["torch_lowbit_path"] = cpu_extension().get_cpu_path()
    except ImportError:
        facts["torch_lowbit_path"] = None
    return facts


def step_key(fn: Callable, args: Sequence[Any], *, dynamic: bool) -> dict:
    """Everything that changes the code compiled for fn(*args): the function, the model's structure,
    the other arguments' shapes (only their rank where dynamic: guards check the rest), versions,
    the CPU path, thread count and inductor's settings."""
    import transformers
    described = []
    for arg in args:
        d = describe_model(arg) if isinstance(arg, nn.Module) else _describe(arg)
        if dynamic and isinstance(arg, Tensor):
            d = ["tensor", arg.dim(), str(arg.dtype), str(arg.device)]
        described.append(d)
    return {"function": _name(fn), "dynamic": dynamic, "args": described,
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_lowbit": __version__, "torch_lowbit_sources": _package_fingerprint(), **_cpu_facts(),
            "threads": torch.get_num_threads(), "grad": torch.is_grad_enabled(),
            "inductor_config": hashlib.sha256(repr(sorted(torch._inductor.config.save_config_portable().items()))
                                              .encode()).hexdigest()}


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Artifacts on disk


class StaleArtifact(Exception):
    """An artifact that must not be used: corrupt, from another key, or traced from changed sources."""


def _traced_sources(compiled) -> list:
    return sorted([s.module, s.firstlineno, s.lastlineno, s.checksum] for s in compiled.source_info().inlined_sources)


def _check_sources(sources: list) -> None:
    from torch._dynamo.package import _hash_sourcelines
    for module_name, first, last, checksum in sources:
        try:
            module = sys.modules.get(module_name) or importlib.import_module(module_name)
            current = _hash_sourcelines(module, first, last)
        except Exception as e:  # a module gone or unreadable: the traced code changed
            raise StaleArtifact(f"traced source {module_name} unreadable ({e})") from e
        if current != checksum:
            raise StaleArtifact(f"traced source {module_name}:{first}-{last} changed")


def save_artifact(path: Path, signing_key: bytes, key: dict, compiled) -> None:
    """Written to a temp file in the same folder, then renamed over `path`: a reader sees the whole
    artifact or none."""
    payload = type(compiled).serialize(compiled).serialized_data
    header = json.dumps({"key": key, "sources": _traced_sources(compiled)}, sort_keys=True, default=str).encode()
    signed = header + b"\n" + payload
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + header + b"\n" + hmac.digest(signing_key, signed, "sha256") + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_artifact(path: Path, signing_key: bytes, key: dict):
    """The AOTCompiledFunction saved at `path`; StaleArtifact when its signature, key or traced
    sources do not match (checked before unpickling)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise StaleArtifact("not a torch_lowbit artifact of this version")
    body = data[len(MAGIC):]
    end = body.find(b"\n")
    if end < 0 or len(body) < end + 1 + 32:
        raise StaleArtifact("truncated")
    header, mac, payload = body[:end], body[end + 1:end + 33], body[end + 33:]
    if not hmac.compare_digest(mac, hmac.digest(signing_key, header + b"\n" + payload, "sha256")):
        raise StaleArtifact("signature mismatch (corrupt, or not written by this cache)")
    meta = json.loads(header)
    if key_digest(meta["key"]) != key_digest(key):
        raise StaleArtifact("made for another model, shape or version")
    _check_sources(meta["sources"])
    try:
        return AOTCompiledFunction.deserialize(payload)
    except Exception as e:  # e.g. a torch that cannot read its own older format
        raise StaleArtifact(f"unreadable ({type(e).__name__}: {e})") from e


# ---------------------------------------------------------------------------------------------
# The cached step


def _skipping_guards() -> bool:
    """Whether the caller runs under set_stance(skip_guard_eval_unsafe=True) (torch keeps the flag
    private); the cached step then skips its own guard check, as Dynamo would."""
    from torch._dynamo import eval_frame
    return bool(getattr(eval_frame, "_is_skip_guard_eval_unsafe_stance", lambda: False)())


class CachedCompile:
    """fn compiled with torch.compile(fullgraph=True) on its first call, loaded from `directory` when a
    process before has compiled it for the same key, saved there otherwise. A call whose arguments
    fail the loaded function's guards (a shape it was not compiled for) runs a plain
    torch.compile(fn) instead, with one log line; `fallback_calls` counts them."""

    def __init__(self, fn: Callable, *, name: str, dynamic: bool, directory: Optional[os.PathLike | str] = None):
        self.fn, self.name, self.dynamic = fn, name, dynamic
        self.directory = open_directory(directory)
        self._compiled = None
        self._guards_passed = False  # once, before the caller may skip guard evaluation
        self._fallback = None
        self.fallback_calls = 0
        self.loaded_from: Optional[Path] = None  # the artifact a warm start loaded
        self.saved_to: Optional[Path] = None  # the artifact a cold start wrote
        self.path: Optional[Path] = None

    def _compile(self, args: Sequence[Any]):
        # float attributes (epsilons, scales) as constants: symbolic floats make AOTAutograd restart the
        # trace (TensorifyScalarRestartAnalysis), which precompile cannot do, and they never vary here
        with torch._dynamo.config.patch(specialize_float=True):
            return torch.compile(self.fn, fullgraph=True, dynamic=self.dynamic,
                                 options={"guard_filter_fn": serializable_guards}).aot_compile((tuple(args), {}))

    def _load_or_compile(self, args: Sequence[Any]):
        key = step_key(self.fn, args, dynamic=self.dynamic)
        self.path = self.directory / f"{self.name}-{key_digest(key)[:32]}.bin"
        signing_key = _signing_key()
        if self.path.exists():
            try:
                compiled = load_artifact(self.path, signing_key, key)
                self.loaded_from = self.path
                return compiled
            except StaleArtifact as e:
                log.warning("torch_lowbit compile cache: rebuilding %s (%s)", self.path, e)
        compiled = self._compile(args)
        save_artifact(self.path, signing_key, key, compiled)
        self.saved_to = self.path
        return compiled

    def __call__(self, *args):
        if self._compiled is None:
            self._compiled = self._load_or_compile(args)
        if (self._guards_passed and _skipping_guards()) or self._compiled.guard_check(*args):
            self._guards_passed = True
            return self._compiled.fn(*args)
        if self._fallback is None:
            log.warning("torch_lowbit compile cache: %s's arguments fail its guards (%s); compiling them with "
                        "torch.compile", self.name,
                        self._compiled._artifacts.guard_manager.check_verbose(self._compiled.prepare_f_locals(*args)))
            self._fallback = torch.compile(self.fn, fullgraph=True, dynamic=self.dynamic)
        self.fallback_calls += 1
        return self._fallback(*args)


def serializable_guards(entries) -> list[bool]:
    """Guards that can be saved: torch cannot serialize identity guards (of classes, code objects,
    closures, globals); what they protect (the same classes and code) is in the key and the checked
    source checksums instead."""
    from torch._dynamo.guards import CheckFunctionManager
    unsupported = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (e.is_global or e.guard_type in unsupported or unsupported.intersection(e.derived_guard_types or ()))
            for e in entries]
