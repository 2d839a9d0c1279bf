"""A layout is how one backend wants a format's codes and group parameters stored: it packs the
format's quantize() output once, unpacks it back (for the reference dequantizer), and calls the
kernels that read it. Layout names and versions are written into checkpoints.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from torch import Tensor

from ..formats.base import Format


class Layout(ABC):
    name: str
    version: int = 1

    @abstractmethod
    def pack(self, fmt: Format, q: dict[str, Tensor]) -> dict[str, Tensor]:
        """Persistent buffers (saved in checkpoints) from a format's quantize() output."""

    @abstractmethod
    def unpack(self, fmt: Format, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        """Inverse of pack: the format-level tensors that fmt.dequantize() reads."""

    @abstractmethod
    def buffer_shapes(self, fmt: Format, out_features: int, in_features: int) -> dict[str, tuple]:
        """Shapes and dtypes of the persistent buffers, to build empty modules before loading."""

    def runtime_buffers(self, fmt: Format) -> dict[str, Tensor]:
        """Non-persistent constants the kernels need (derived from the format, never saved)."""
        return {}

    @abstractmethod
    def linear(self, fmt: Format, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str) -> Tensor:
        """y = x @ W.T + bias with the kernels of `backend` ("cpu" or "triton")."""


_LAYOUTS: dict[str, Layout] = {}
_DEFAULT_FOR_FAMILY: dict[str, str] = {}


def register_layout(layout: Layout, *, default_for: Optional[str] = None) -> Layout:
    _LAYOUTS[layout.name] = layout
    if default_for is not None:
        _DEFAULT_FOR_FAMILY[default_for] = layout.name
    return layout


def get_layout(name: str) -> Layout:
    if name not in _LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; known layouts: {', '.join(sorted(_LAYOUTS))} "
                         "(a checkpoint from a newer torch_lowbit? upgrade the package)")
    return _LAYOUTS[name]


def default_layout(fmt: Format) -> Layout:
    family = fmt.layout_family
    if family not in _DEFAULT_FOR_FAMILY:
        raise ValueError(f"format {fmt.name} (family {family}) has no kernel layout registered")
    return _LAYOUTS[_DEFAULT_FOR_FAMILY[family]]
