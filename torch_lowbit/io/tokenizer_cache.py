"""A GGUF file's tokenizer, converted by transformers once and kept as JSON (tokenizer.json,
tokenizer_config.json, chat_template.jinja) under <cache>/tokenizers/<key>/, so that a later import of
the same file loads those (~0.1 s) instead of transformers parsing the file's metadata again and
converting its vocabulary (3-6 s).

<cache> is $TORCH_LOWBIT_CACHE or ~/.cache/torch_lowbit; the tokenizers folder has mode 0700 and is
used only when it is this user's and nobody else can write to it. The key hashes the file's resolved
path, size and mtime with the transformers / tokenizers versions (their conversion may change). An
entry is written to a temporary folder and renamed into place, so a crash never leaves half of one;
an entry that fails to load is removed and converted again. The MAX_ENTRIES most recently used
entries are kept (a moved or rewritten file leaves its old entry behind).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from ..core.cache import cache_dir

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when what an entry holds changes
REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_ENTRIES = 16  # ~3.4 MB each for a 49k vocabulary
PARTIAL_PREFIX = ".partial-"
STALE_PARTIAL_S = 3600  # a temporary folder this old was left by a crashed writer, not a running one


def tokenizer_cache_dir() -> Optional[Path]:
    """<cache>/tokenizers, created with mode 0700; None (with a warning) when it cannot be created or
    belongs to another user or is writable by others (its files decide how text is tokenized)."""
    path = cache_dir() / "tokenizers"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.stat()
    except OSError as e:
        log.warning("tokenizer cache %s unusable (%s); converting the GGUF tokenizer every time", path, e)
        return None
    if (hasattr(os, "getuid") and info.st_uid != os.getuid()) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("tokenizer cache %s belongs to another user or is writable by others (`chmod 700 %s`); "
                    "converting the GGUF tokenizer every time", path, path)
        return None
    return path


def entry_key(path: Path) -> str:
    """The cache key of a GGUF file: its resolved path, size and mtime, and the converters' versions."""
    import tokenizers
    import transformers
    info = path.stat()
    ident = [CACHE_VERSION, str(path.resolve()), info.st_size, info.st_mtime_ns, transformers.__version__,
             tokenizers.__version__]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:32]


def _load(entry: Path):
    from transformers import AutoTokenizer
    missing = [name for name in REQUIRED_FILES if not (entry / name).is_file()]
    if missing:
        raise FileNotFoundError(f"no {', '.join(missing)}")
    return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)


def cached_tokenizer(path: Path, convert: Callable[[], object]):
    """The tokenizer of the GGUF file at path: loaded from its cache entry, or convert()ed (transformers'
    own conversion), saved as an entry and loaded back from it (every run returns the same thing)."""
    root = tokenizer_cache_dir()
    if root is None:
        return convert()
    entry = root / entry_key(path)
    if entry.is_dir():
        try:
            tokenizer = _load(entry)
        except Exception as e:  # truncated or edited JSON, a file removed: convert again
            log.warning("tokenizer cache entry %s unreadable (%s: %s); converting the tokenizer again", entry,
                        type(e).__name__, e)
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.utime(entry)  # recently used: kept by _prune
            return tokenizer
    tokenizer = convert()
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=PARTIAL_PREFIX))
    try:
        tokenizer.save_pretrained(str(tmp))
        os.rename(tmp, entry)  # atomic; fails if another process renamed its copy first, which is as good
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not entry.is_dir():
            log.warning("tokenizer cache entry %s not written (%s); the tokenizer is converted again next time",
                        entry, e)
            return tokenizer
    _prune(root)
    return _load(entry)


def _prune(root: Path) -> None:
    """Removes all but the MAX_ENTRIES most recently used entries, and crashed writers' temporary folders."""
    entries, now = [], time.time()
    for p in root.iterdir():
        try:
            mtime = p.stat().st_mtime
        except OSError:
            continue  # removed meanwhile by another process
        if not p.name.startswith(PARTIAL_PREFIX):
            entries.append((mtime, p))
        elif now - mtime > STALE_PARTIAL_S:
            shutil.rmtree(p, ignore_errors=True)
    for _, p in sorted(entries, reverse=True)[MAX_ENTRIES:]:
        shutil.rmtree(p, ignore_errors=True)
