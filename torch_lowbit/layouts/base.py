"""A layout is how one backend wants a format's codes and group parameters stored: it packs the
format's quantize() output once, unpacks it back (for the reference dequantizer), and calls the
kernels that read it. Layout names and versions are written into checkpoints.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from torch import Tensor

from ..core.packing import row_bytes_codes
from ..formats.base import Format
from ..ops import Backend, OpCall


class Layout(ABC):
    name: str
    version: int = 1
    backends: tuple[str, ...] = ("cpu", "triton")  # kernel backends that read this layout
    isa_paths: bool = True  # its CPU kernels differ per ISA path (tests run each path)
    cpu_specific: bool = False  # picked per CPU (x86 tiles, ARM interleavings): loads repack to the CPU's own

    def supports(self, fmt: Format) -> bool:
        """Whether this layout can hold the format (e.g. integer code tables only)."""
        return True

    def holds_width(self, fmt: Format, in_features: int) -> bool:
        """Whether it can hold a layer of that many input features (default_layout passes over it when
        not, e.g. the int8 tiles' 32-feature activation blocks)."""
        return True

    def reference_activations(self, x: Tensor, fmt: Optional[Format] = None,
                              buffers: Optional[dict[str, Tensor]] = None) -> Tensor:
        """The activations its kernels effectively multiply the dequantized weight with (identity for
        float kernels; the int8 round trip for int8-activation kernels, taken in the rotated basis
        for rotated formats). Tests build the expected output from this."""
        return x

    @abstractmethod
    def pack(self, fmt: Format, q: dict[str, Tensor]) -> dict[str, Tensor]:
        """Persistent buffers (saved in checkpoints) from a format's quantize() output."""

    def pack_row_bytes(self, fmt: Format, q: dict[str, Tensor]) -> dict[str, Tensor]:
        """pack() of a 4- or 8-bit scalar format's q whose "codes" are its rows' bytes
        (core.packing.row_bytes: a GGUF block's payload). This base unpacks them; layouts whose
        buffers are those bytes rearranged move them instead."""
        return self.pack(fmt, {**q, "codes": row_bytes_codes(q["codes"], fmt.code_bits)})

    @abstractmethod
    def unpack(self, fmt: Format, buffers: dict[str, Tensor], out_features: int, in_features: int) -> dict[str, Tensor]:
        """Inverse of pack: the format-level tensors that fmt.dequantize() reads."""

    def gather_rows(self, fmt: Format, buffers: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        """The format-level tensors (as unpack's) of the given output rows only, reading only their
        packed bytes: what an embedding lookup dequantizes (nn.QuantEmbedding)."""
        raise ValueError(f"layout {self.name} cannot gather single rows; use a layout that can "
                         "(lut{{b}}_i8_n16, lut4_rowmajor, stream_rowmajor) for an embedding")

    @abstractmethod
    def buffer_shapes(self, fmt: Format, out_features: int, in_features: int) -> dict[str, tuple]:
        """Shapes and dtypes of the persistent buffers, to build empty modules before loading."""

    def runtime_buffers(self, fmt: Format) -> dict[str, Tensor]:
        """Non-persistent constants the kernels need (derived from the format, never saved)."""
        return {}

    @abstractmethod
    def linear(self, fmt: Format, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
               backend: str, out_features: int) -> Tensor:
        """y = x @ W.T + bias with the kernels of `backend` ("cpu" or "triton")."""

    def lut_i8_args(self, fmt: Format, buffers: dict[str, Tensor]) -> Optional[tuple]:
        """The weight arguments of lut_i8_linear (qweight, scales, mins, lut, code_bits, group, sub_groups,
        sub_scales, sub_mins) when this layout's CPU forward is that one op on x as it comes (no rotation, no reordering): the
        native decoder calls the kernels with them. None otherwise."""
        return None

    def linear_int_acts(self, fmt: Format, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
                        backend: str, out_features: int, bits: int, clip: float, block: int = 0) -> Optional[Tensor]:
        """y = q(x) @ W.T + bias with x rounded per token (block > 0: per block of that many features)
        to `bits` (symmetric, clip ratio `clip`) inside the kernel, which multiplies the integer
        activations (QuaRot's A8 / A4); None where this layout's kernels cannot (nn.ActQuantLinear then
        rounds x in torch and calls linear)."""
        return None

    def kernel_ops(self, fmt: Format) -> tuple[tuple[str, Optional[str]], ...]:
        """(op, Triton module or None) of each torch_lowbit op this layout's forward runs for fmt, in
        order (the format index reads it; empty: plain torch only)."""
        return _ROTATION_OPS if getattr(fmt, "rotate", False) else ()

    def fused_op(self, fmt: Format, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor],
                 backend: Backend) -> Tensor:
        """The one fused op of this layout's forward that has a Triton kernel, called through its typed
        wrapper (torch_lowbit/ops/<family>.py) with `backend` (x already rotated for rotated formats).
        Layouts without one (the int8 tiles *_i8_n16 and the q4_{R}x{S} interleavings: CPU kernels only;
        palette_dense: a dense fallback) raise a clear error naming the format's CUDA layout to repack
        into."""
        raise ValueError(f"layout {self.name} runs no fused Triton op; repack the module with "
                         f"layout=\"{default_layout(fmt, 'cuda').name}\" (the CUDA default for {fmt.name})")

    def op_call(self, fmt: Format, buffers: dict[str, Tensor], x: Tensor, bias: Optional[Tensor]) -> OpCall:
        """(op, kernels, args) of fused_op, not made: torch.ops.torch_lowbit.<op>(*args), whose CUDA impl
        is the same-named function of triton_kernels/<kernels>.py (the GPU benchmarks and tools call that
        function with options of their own)."""
        return self.fused_op(fmt, buffers, x, bias, OpCall)


_ROTATION_OPS = (("hadamard_transform", "hadamard"),)  # x' = (x * s) @ H of the rotated formats


_LAYOUTS: dict[str, Layout] = {}
_DEFAULTS: dict[tuple[str, str], str] = {}  # (format family, device type or "any") -> layout name


def register_layout(layout: Layout, *, default_for: Optional[str] = None, device: str = "any") -> Layout:
    _LAYOUTS[layout.name] = layout
    if default_for is not None:
        _DEFAULTS[(default_for, device)] = layout.name
    return layout


def layouts() -> list[str]:
    return sorted(_LAYOUTS)


# Layouts renamed since checkpoints were first written: old name -> current name. Checkpoints and HF
# folders store layout names, so an old name keeps loading (the buffers are the same).
RENAMED_LAYOUTS = {
    "lowbit_rowmajor": "stream_rowmajor",  # it also holds q8_0's 8-bit streams, not only low bit widths
}


def get_layout(name: str) -> Layout:
    name = RENAMED_LAYOUTS.get(name, name)
    if name not in _LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; known layouts: {', '.join(sorted(_LAYOUTS))} "
                         "(a checkpoint from a newer torch_lowbit? upgrade the package)")
    return _LAYOUTS[name]


_CPU_PREFERENCES: list = []  # fmt -> Layout or None: layouts a CPU's features pick (the ARM interleavings)


def register_cpu_preference(choose) -> None:
    _CPU_PREFERENCES.append(choose)


def default_layout(fmt: Format, device_type: str = "cpu", in_features: Optional[int] = None) -> Layout:
    """The layout a new QuantLinear on `device_type` packs into: on the CPU the one this CPU's features
    pick (ARM: an interleaved q4 layout; vq: the int8 tiles), else the device's own if it holds the
    format, else the family's portable one. in_features: skip layouts that cannot hold that width."""
    def fits(layout: Layout) -> bool:
        return in_features is None or layout.holds_width(fmt, in_features)

    if device_type == "cpu":
        for choose in _CPU_PREFERENCES:
            chosen = choose(fmt)
            if chosen is not None and fits(chosen):
                return chosen
    for key in ((fmt.layout_family, device_type), (fmt.layout_family, "any")):
        name = _DEFAULTS.get(key)
        if name is not None and _LAYOUTS[name].supports(fmt) and fits(_LAYOUTS[name]):
            return _LAYOUTS[name]
    raise ValueError(f"format {fmt.name} (family {fmt.layout_family}) has no kernel layout registered")
