"""QuantLinear: an nn.Linear replacement holding one format's packed weight."""
from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..formats import Format, GeneralVQ, PaletteFormat, get_format
from ..layouts import Layout, default_layout, get_layout
from ..ops import resolve_backend

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
log = logging.getLogger(__name__)


class QuantLinear(nn.Module):
    """y = x @ W.T + bias with W stored in a low-bit format.

    The packed weight lives in persistent buffers named by the layout (saved by save_quantized);
    `dequantize()` returns the fp32 weight the forward computes with. A fused module (q/k/v or
    gate/up) concatenates several projections along out_features and records their split sizes.
    """

    def __init__(self, in_features: int, out_features: int, fmt: Union[str, Format],
                 buffers: dict[str, Tensor], bias: Optional[Tensor] = None, *,
                 layout: Optional[Layout] = None, split_sizes: Optional[Sequence[int]] = None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.fmt = get_format(fmt).for_layer(self.in_features)
        self.layout = _resolve_layout(layout, self.fmt, "cpu", self.in_features)
        self.split_sizes = list(split_sizes) if split_sizes is not None else None
        if self.split_sizes is not None and sum(self.split_sizes) != self.out_features:
            raise ValueError(f"split sizes {self.split_sizes} do not add up to out_features={out_features}")
        self._buffer_names = tuple(buffers)
        for name, t in buffers.items():
            self.register_buffer(name, t)
        self.reset_runtime_buffers()
        self.register_buffer("bias", bias)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: Union[str, Format], *, layout: Union[None, str, Layout] = None,
                    importance: Optional[Tensor] = None, hessian: Optional[Tensor] = None) -> "QuantLinear":
        """Quantizes an nn.Linear (its weight and bias) into the given format (name or config).

        layout: a layout name or object (default: the best one for the weight's device).
        importance [in]: per-input-feature error weights (E[x²] of calibration inputs) for
        importance-weighted rounding; hessian [in, in] (E[x xᵀ]): GPTQ rounding instead."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        return cls.from_weights([linear.weight], [linear.bias], fmt, layout=layout, importance=importance,
                                hessian=hessian)

    @classmethod
    def from_linears(cls, linears: Sequence[nn.Linear], fmt: Union[str, Format], *,
                     layout: Optional[Layout] = None, importance: Optional[Tensor] = None,
                     hessian: Optional[Tensor] = None) -> "QuantLinear":
        """One fused module for several projections of the same input (outputs split in order)."""
        in_f = {l.in_features for l in linears}
        if len(in_f) != 1:
            raise ValueError(f"fused projections must share in_features, got {sorted(in_f)}")
        return cls.from_weights([l.weight for l in linears], [l.bias for l in linears], fmt, layout=layout,
                                split=len(linears) > 1, importance=importance, hessian=hessian)

    @classmethod
    def from_weights(cls, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
                     fmt: Union[str, Format], *, layout: Optional[Layout] = None, split: bool = False,
                     importance: Optional[Tensor] = None, hessian: Optional[Tensor] = None) -> "QuantLinear":
        weight = torch.cat([w.detach() for w in weights], dim=0) if len(weights) > 1 else weights[0].detach()
        fmt = get_format(fmt)
        if isinstance(weight, Tensor) and weight.dim() == 2:
            fmt = fmt.for_layer(weight.shape[1])
        fmt.check_weight(weight)
        layout = _resolve_layout(layout, fmt, weight.device.type, weight.shape[1])
        if hessian is not None and isinstance(fmt, (PaletteFormat, GeneralVQ)):
            from ..calibrate.ldlq import ldlq_quantize
            q = ldlq_quantize(fmt, weight, hessian)
        elif hessian is not None:
            from ..calibrate.gptq import gptq_quantize
            q = gptq_quantize(fmt, weight, hessian)
        else:
            q = fmt.quantize(weight, importance)
        buffers = layout.pack(fmt, q)
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else weight.new_zeros(w.shape[0])
                              for w, b in zip(weights, biases)]).clone()
        else:
            bias = None
        out_f, in_f = weight.shape
        return cls(in_f, out_f, fmt, buffers, bias, layout=layout,
                   split_sizes=[w.shape[0] for w in weights] if split else None)

    @classmethod
    def from_quantized(cls, fmt: Union[str, Format], q: dict[str, Tensor], out_features: int, in_features: int,
                       bias: Optional[Tensor] = None, layout: Union[None, str, Layout] = None,
                       split_sizes: Optional[Sequence[int]] = None,
                       codes_as_row_bytes: bool = False) -> "QuantLinear":
        """A module from a format's already-quantized tensors q (exactly what fmt.quantize() returns,
        e.g. q8_0 {"codes": uint8 [N, K], "scales": fp16 [N, K/32]} read from a GGUF file), packed into
        `layout` (default: the best one for q's device) without re-quantizing: dequantize() equals
        fmt.dequantize(q) bit for bit. bias: float [out_features] or None. codes_as_row_bytes: 4- and
        8-bit codes given as each row's bytes (core.packing.row_bytes, a GGUF block's payload), which
        the CPU layouts rearrange without unpacking."""
        fmt = get_format(fmt).for_layer(in_features)
        fmt.check_quantized(q, out_features, in_features, codes_as_row_bytes=codes_as_row_bytes)
        if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (out_features,)
                                 or not bias.is_floating_point()):
            raise ValueError(f"from_quantized: bias must be a float tensor of shape [{out_features}] or None")
        layout = _resolve_layout(layout, fmt, next(iter(q.values())).device.type, in_features)
        buffers = layout.pack_row_bytes(fmt, q) if codes_as_row_bytes else layout.pack(fmt, q)
        return cls(in_features, out_features, fmt, buffers, bias.detach().clone() if bias is not None else None,
                   layout=layout, split_sizes=split_sizes)

    @classmethod
    def empty(cls, in_features: int, out_features: int, fmt: Union[str, Format], *, bias: bool,
              bias_dtype: torch.dtype = torch.float32, layout: Optional[Layout] = None,
              split_sizes: Optional[Sequence[int]] = None, device="meta") -> "QuantLinear":
        """An unfilled module of the right shapes (checkpoint loading assigns its buffers)."""
        fmt = get_format(fmt).for_layer(in_features)
        layout = _resolve_layout(layout, fmt, "cpu", in_features)
        shapes = layout.buffer_shapes(fmt, out_features, in_features)
        buffers = {k: torch.empty(shape, dtype=dt, device=device) for k, (shape, dt) in shapes.items()}
        b = torch.empty(out_features, dtype=bias_dtype, device=device) if bias else None
        return cls(in_features, out_features, fmt, buffers, b, layout=layout, split_sizes=split_sizes)

    # -- use ---------------------------------------------------------------------------------
    @property
    def packed(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in self._buffer_names}

    def dequantize(self) -> Tensor:
        """The fp32 [out_features, in_features] weight this module's forward is equivalent to."""
        return self.fmt.dequantize(self.layout.unpack(self.fmt, self.packed, self.out_features, self.in_features))

    def reference_activations(self, x: Tensor) -> Tensor:
        """fp32 activations that, times dequantize().T, give exactly what the kernels compute
        (x itself for float kernels; the int8 round trip for int8-activation kernels)."""
        return self.layout.reference_activations(x.float(), self.fmt, self.packed)

    def repack(self, layout: Union[str, Layout]) -> "QuantLinear":
        """The same quantized weight in another layout (e.g. "lut4_rowmajor" for Triton/CUDA), in place."""
        new = _resolve_layout(layout, self.fmt, "cpu")
        if new is self.layout:
            return self
        q = self.layout.unpack(self.fmt, self.packed, self.out_features, self.in_features)
        device = getattr(self, self._buffer_names[0]).device
        for name in self._kernel_buffer_names:
            delattr(self, name)
        self.layout = new
        buffers = new.pack(self.fmt, q)
        self._buffer_names = tuple(buffers)
        for name, t in buffers.items():
            self.register_buffer(name, t.to(device))
        self.reset_runtime_buffers()
        return self

    def reset_runtime_buffers(self) -> None:
        """(Re)builds the non-persistent constants the layout's kernels read (never saved), on the
        packed weight's device (CPU while that is meta). Loaders that swap non-persistent buffers
        for empty placeholders (transformers' from_pretrained) call it afterwards."""
        device = getattr(self, self._buffer_names[0]).device
        runtime = self.layout.runtime_buffers(self.fmt)
        self._kernel_buffer_names = self._buffer_names + tuple(runtime)
        for name, t in runtime.items():
            self.register_buffer(name, t.to(device if device.type != "meta" else "cpu"), persistent=False)

    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed.values())

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear({self.fmt.name}): input has {x.shape[-1]} features, "
                             f"expected in_features={self.in_features}")
        if x.dtype not in _ACT_DTYPES:
            raise TypeError(f"QuantLinear({self.fmt.name}): activations must be float32, bfloat16 or "
                            f"float16, got {x.dtype}")
        bufs = self._buffers  # direct: nn.Module.__getattr__ costs ~0.5 µs a buffer on every decode step
        qweight = bufs[self._buffer_names[0]]
        if x.device != qweight.device:
            raise RuntimeError(f"QuantLinear({self.fmt.name}): input is on {x.device} but the weight is on "
                               f"{qweight.device}; move the model or the input with .to()")
        backend = resolve_backend(x.device.type)
        if backend == "reference":
            bias = self.bias.to(x.dtype) if self.bias is not None else None
            return F.linear(x, self.dequantize().to(x.dtype), bias)
        buffers = {name: bufs[name] for name in self._kernel_buffer_names}
        return self.layout.linear(self.fmt, buffers, x, bufs["bias"], backend, self.out_features)

    def forward_int_acts(self, x: Tensor, bits: int, clip: float, block: int = 0) -> Optional[Tensor]:
        """forward with x rounded per token (block > 0: per block of that many features) to `bits`
        (symmetric) inside the kernel, which multiplies the integer activations; None when this layout /
        backend cannot (see Layout.linear_int_acts)."""
        bufs = self._buffers
        if x.shape[-1] != self.in_features or x.device != bufs[self._buffer_names[0]].device:
            return None  # forward raises the clear error
        backend = resolve_backend(x.device.type)
        if backend == "reference":
            return None
        buffers = {name: bufs[name] for name in self._kernel_buffer_names}
        return self.layout.linear_int_acts(self.fmt, buffers, x, bufs["bias"], backend, self.out_features, bits, clip,
                                           block)

    def extra_repr(self) -> str:
        s = f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}, " \
            f"layout={self.layout.name}, bias={self.bias is not None}"
        return s + (f", split_sizes={self.split_sizes}" if self.split_sizes else "")


def _resolve_layout(layout: Union[None, str, Layout], fmt: Format, device_type: str,
                    in_features: Optional[int] = None) -> Layout:
    if layout is None:
        return default_layout(fmt, device_type, in_features)
    layout = get_layout(layout) if isinstance(layout, str) else layout
    if not layout.supports(fmt):
        raise ValueError(f"layout {layout.name} cannot hold format {fmt.name}")
    return layout


def repack_for_this_cpu(model: nn.Module) -> int:
    """Repacks every CPU QuantLinear held in another CPU's layout (the x86 tiles lut{b}_i8_n16 <-> the ARM
    interleavings q4_RxS) into the one this CPU picks (default_layout), with one info log line per
    (from, to); the weights and the kernels' results are unchanged. Returns how many were repacked."""
    moved: dict[tuple[str, str], int] = {}
    # a head tied to a QuantEmbedding shares its buffers (and so its row-gathering layout): left as it is
    shared = {t.data_ptr() for m in model.modules() if not isinstance(m, QuantLinear) and hasattr(m, "layout")
              for t in m._buffers.values() if t is not None}
    for m in model.modules():
        if not isinstance(m, QuantLinear) or not m.layout.cpu_specific or \
                next(iter(m.packed.values())).device.type != "cpu" or \
                any(t.data_ptr() in shared for t in m.packed.values()):
            continue
        target = default_layout(m.fmt, "cpu", m.in_features)
        if target.cpu_specific and target is not m.layout:
            key = (m.layout.name, target.name)
            m.repack(target)
            moved[key] = moved.get(key, 0) + 1
    for (src, dst), n in moved.items():
        log.info("torch_lowbit: repacked %d layer(s) from %s to %s, this CPU's layout", n, src, dst)
    return sum(moved.values())
