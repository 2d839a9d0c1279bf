"""Format registry: names -> default configs, and checkpoint kinds -> config classes."""
from __future__ import annotations

from .base import Format

_BY_NAME: dict[str, Format] = {}
_BY_KIND: dict[str, type[Format]] = {}


def register_format(fmt: Format) -> Format:
    """Registers a named default config (and its class for checkpoint loading)."""
    if fmt.name in _BY_NAME and _BY_NAME[fmt.name] != fmt:
        raise ValueError(f"format name {fmt.name!r} is already registered")
    _BY_NAME[fmt.name] = fmt
    _BY_KIND.setdefault(fmt.kind, type(fmt))
    return fmt


def formats() -> list[str]:
    """Names of all registered formats."""
    return sorted(_BY_NAME)


def get_format(fmt: "str | Format") -> Format:
    """A format config from a registered name or a config object."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str):
        if fmt in _BY_NAME:
            return _BY_NAME[fmt]
        raise ValueError(f"unknown format {fmt!r}; registered formats: {', '.join(formats())}")
    raise TypeError(f"a format must be a name (str) or a Format config, got {type(fmt).__name__}")


def format_from_json(d: dict) -> Format:
    """Rebuilds a config saved by Format.to_json (checkpoint metadata)."""
    kind = d.get("kind")
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise ValueError(f"checkpoint uses format kind {kind!r}, which this torch_lowbit does not know; "
                         f"known kinds: {', '.join(sorted(_BY_KIND))} (upgrade torch_lowbit)")
    if d.get("version") != cls.version:
        raise ValueError(f"checkpoint format {kind!r} has version {d.get('version')}, this torch_lowbit "
                         f"implements version {cls.version}; re-quantize the model from float weights")
    return cls(**d["params"])
