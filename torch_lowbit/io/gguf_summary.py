"""What from_gguf will make of a file's tensors, said before any weight is read: each tensor is kept
as its blocks (a torch_lowbit format holds them exactly), requantized (requantize=), dequantized to
float, or refused (a type no dequantizer here reads), with the memory the model will take.

One line per import: INFO when every weight matrix keeps a compact form, WARNING when weight matrices
become float (the case that multiplies memory), naming the types and the fix.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

KEPT, REQUANTIZED, DEQUANTIZED = "kept", "requantized", "dequantized"

# Types whose bytes a dequantizer here reads (gguf.quants and the plain floats).
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def readable_type(tensor_type) -> bool:
    """Whether gguf.quants (or a plain float view) can read this GGML tensor type."""
    from gguf import quants
    return tensor_type.name in _FLOAT_TYPES or tensor_type in quants._type_traits


@dataclasses.dataclass
class ImportSummary:
    """Tensors by (action, GGUF type, what they become) and the bytes they take once loaded."""

    file_name: str
    file_bytes: int
    dtype: torch.dtype
    counts: dict = dataclasses.field(default_factory=dict)  # (action, type, target) -> tensors
    loaded_bytes: int = 0
    float_matrix_bytes: int = 0  # weight matrices that become float: what requantize= would shrink
    float_matrix_types: set = dataclasses.field(default_factory=set)

    def add(self, t, action: str, target: Optional[str] = None, bits_per_weight: Optional[float] = None) -> None:
        """One tensor `t` (a gguf ReaderTensor): kept (target = format), requantized (target = format,
        bits_per_weight its cost) or dequantized (target None: to self.dtype)."""
        n = int(np.prod([int(s) for s in t.shape]))
        if action == KEPT:
            nbytes = int(t.n_bytes)
        elif action == REQUANTIZED:
            nbytes = int(n * bits_per_weight / 8)
        else:
            nbytes = n * torch.empty((), dtype=self.dtype).element_size()
            target = str(self.dtype).removeprefix("torch.")
            if len(t.shape) > 1 and t.tensor_type.name not in _FLOAT_TYPES:
                self.float_matrix_bytes += nbytes
                self.float_matrix_types.add(t.tensor_type.name)
        key = (action, t.tensor_type.name, target)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.loaded_bytes += nbytes

    def line(self) -> str:
        parts = []
        for action, label in ((KEPT, "kept as blocks"), (REQUANTIZED, "requantized"), (DEQUANTIZED, "dequantized")):
            items = sorted((k, c) for k, c in self.counts.items() if k[0] == action)
            if items:
                total = sum(c for _, c in items)
                what = ", ".join(f"{typ} x{c} -> {target}" for (_, typ, target), c in items)
                parts.append(f"{label} {total} ({what})")
        return (f"from_gguf {self.file_name}: {'; '.join(parts) or 'no tensors'}; "
                f"~{self.loaded_bytes / 1e6:.1f} MB in memory (file {self.file_bytes / 1e6:.1f} MB)")

    def fix(self) -> Optional[str]:
        """The advice when weight matrices become float, else None."""
        if not self.float_matrix_bytes:
            return None
        return (f"{self.float_matrix_bytes / 1e6:.1f} MB of weight matrices ({', '.join(sorted(self.float_matrix_types))}) "
                "become float: torch_lowbit has no format for those blocks; requantize='q4_0' (or another "
                "format) quantizes them instead")
