"""QuantEmbedding: an nn.Embedding replacement holding a scalar-codebook format's (or a K-quant's)
packed weight, and `quantize_embeddings_`, which quantizes a model's input embedding and its LM head —
one packed copy for both when the head is tied to the embedding (as llama.cpp keeps token_embd in Q8_0).

A lookup gathers only the packed bytes of the rows it reads and dequantizes those (the layout's
`gather_rows`), so the float table never exists in memory. The tied head is a QuantLinear whose
persistent buffers ARE the embedding's tensors (same storage): save_quantized stores them once
(an alias), load_quantized shares them again.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from ..formats import Format, KQuantFormat, ScalarCodebookFormat, get_format
from ..layouts import Layout
from .linear import QuantLinear, _resolve_layout


def _row_format(fmt: Union[str, Format]) -> Format:
    """The format, if its rows dequantize on their own (what a lookup gathers): the scalar-codebook group
    formats and the K-quants."""
    fmt = get_format(fmt)
    if not isinstance(fmt, (ScalarCodebookFormat, KQuantFormat)):
        raise ValueError(f"QuantEmbedding holds scalar-codebook group formats (q8_0, q4_0, int4_g*, ...) and the "
                         f"K-quants (q2_k .. q6_k), not {fmt.name}: pick one of those for the embedding")
    return fmt


class QuantEmbedding(nn.Module):
    """out = dequantize(W)[input_ids] with W [num_embeddings, embedding_dim] stored in a low-bit
    format, in `out_dtype` (the float embedding's dtype). Buffers are named by the layout, as
    QuantLinear's; `tied_head()` is the LM head sharing them."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: Union[str, Format], buffers: dict[str, Tensor],
                 *, layout: Union[None, str, Layout] = None, padding_idx: Optional[int] = None,
                 out_dtype: torch.dtype = torch.float32, scale: float = 1.0):
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.fmt = _row_format(fmt)
        self.layout = _resolve_layout(layout, self.fmt, "cpu")
        self.padding_idx = padding_idx
        if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"QuantEmbedding: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
        self.out_dtype = out_dtype
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not float(scale) == float(scale) \
                or abs(float(scale)) == float("inf"):
            raise ValueError(f"QuantEmbedding: scale must be a finite number, got {scale!r}")
        self.scale = float(scale)  # rows are multiplied by it (Gemma's embeddings scaled by sqrt(hidden))
        expected = self.layout.buffer_shapes(self.fmt, self.num_embeddings, self.embedding_dim)
        if set(buffers) != set(expected):
            raise ValueError(f"QuantEmbedding: layout {self.layout.name} packs buffers {sorted(expected)}, got "
                             f"{sorted(buffers)}")
        self._buffer_names = tuple(buffers)
        for name, t in buffers.items():
            self.register_buffer(name, t)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, fmt: Union[str, Format], *,
                       layout: Union[None, str, Layout] = None) -> "QuantEmbedding":
        """Quantizes an nn.Embedding's table (one row per token, groups along embedding_dim)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"from_embedding expects an nn.Embedding, got {type(embedding).__name__}")
        fmt = _row_format(fmt)
        weight = embedding.weight.detach()
        fmt.check_weight(weight, "embedding weight")
        return cls.from_quantized(fmt, fmt.quantize(weight), embedding.num_embeddings, embedding.embedding_dim,
                                  layout=layout, padding_idx=embedding.padding_idx, out_dtype=weight.dtype,
                                  scale=embedding_scale(embedding))

    @classmethod
    def from_quantized(cls, fmt: Union[str, Format], q: dict[str, Tensor], num_embeddings: int, embedding_dim: int,
                       *, layout: Union[None, str, Layout] = None, padding_idx: Optional[int] = None,
                       out_dtype: torch.dtype = torch.float32, codes_as_row_bytes: bool = False,
                       scale: float = 1.0) -> "QuantEmbedding":
        """From a format's already-quantized tensors q (what fmt.quantize() returns for the
        [num_embeddings, embedding_dim] table, e.g. a GGUF token_embd), packed without re-quantizing:
        dequantize() equals fmt.dequantize(q) bit for bit. layout default: the CPU default for the
        format if q is on the CPU (q8_0: lut8_i8_n16), so tied_head() runs the CPU kernels.
        codes_as_row_bytes: as QuantLinear.from_quantized's. scale: what each row is multiplied by
        (embedding_scale of the module it replaces)."""
        fmt = _row_format(fmt)
        fmt.check_quantized(q, num_embeddings, embedding_dim, codes_as_row_bytes=codes_as_row_bytes)
        layout = _resolve_layout(layout, fmt, next(iter(q.values())).device.type)
        buffers = layout.pack_row_bytes(fmt, q) if codes_as_row_bytes else layout.pack(fmt, q)
        return cls(num_embeddings, embedding_dim, fmt, buffers, layout=layout, padding_idx=padding_idx,
                   out_dtype=out_dtype, scale=scale)

    @classmethod
    def empty(cls, num_embeddings: int, embedding_dim: int, fmt: Union[str, Format], *,
              layout: Union[None, str, Layout] = None, padding_idx: Optional[int] = None,
              out_dtype: torch.dtype = torch.float32, device="meta", scale: float = 1.0) -> "QuantEmbedding":
        """An unfilled module of the right shapes (checkpoint loading assigns its buffers)."""
        fmt = _row_format(fmt)
        layout = _resolve_layout(layout, fmt, "cpu")
        shapes = layout.buffer_shapes(fmt, num_embeddings, embedding_dim)
        buffers = {k: torch.empty(shape, dtype=dt, device=device) for k, (shape, dt) in shapes.items()}
        return cls(num_embeddings, embedding_dim, fmt, buffers, layout=layout, padding_idx=padding_idx,
                   out_dtype=out_dtype, scale=scale)

    def tied_head(self, bias: Optional[Tensor] = None) -> QuantLinear:
        """The LM head y = x @ W.T (+ bias) on this embedding's own packed tensors (no copy): a
        QuantLinear [embedding_dim -> num_embeddings] in the same layout (the rows' scale is the
        embedding's alone: a tied head multiplies by the stored table, as transformers' does)."""
        if bias is not None and tuple(bias.shape) != (self.num_embeddings,):
            raise ValueError(f"tied_head: bias must have {self.num_embeddings} elements, got {tuple(bias.shape)}")
        return QuantLinear(self.embedding_dim, self.num_embeddings, self.fmt, self.packed,
                           bias.detach().clone() if bias is not None else None, layout=self.layout)

    # -- use ---------------------------------------------------------------------------------
    @property
    def packed(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in self._buffer_names}

    def dequantize(self) -> Tensor:
        """The whole fp32 [num_embeddings, embedding_dim] table (tests, export; forward never builds it)."""
        return self.fmt.dequantize(self.layout.unpack(self.fmt, self.packed, self.num_embeddings, self.embedding_dim))

    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed.values())

    def forward(self, input_ids: Tensor) -> Tensor:
        if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"QuantEmbedding: input_ids must be an integer tensor, got {input_ids.dtype}")
        rows = input_ids.reshape(-1).long()
        if not torch.compiler.is_compiling() and rows.numel() and \
                (int(rows.min()) < 0 or int(rows.max()) >= self.num_embeddings):
            raise IndexError(f"QuantEmbedding: token ids must be in [0, {self.num_embeddings}), got "
                             f"[{int(rows.min())}, {int(rows.max())}]")
        q = self.layout.gather_rows(self.fmt, self.packed, rows)
        out = self.fmt.dequantize(q).to(self.out_dtype)
        if self.scale != 1.0:  # in the output dtype, as Gemma's scaled embedding multiplies
            out = out * torch.tensor(self.scale, dtype=self.out_dtype)
        return out.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt.name}, layout={self.layout.name}"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
                + (f", scale={self.scale:g}" if self.scale != 1.0 else ""))


def embedding_scale(embedding: nn.Module) -> float:
    """What an embedding module multiplies its rows by: transformers' scaled embeddings (Gemma 3's
    Gemma3TextScaledWordEmbedding) keep it as `scalar_embed_scale`; 1 for a plain nn.Embedding."""
    return float(getattr(embedding, "scalar_embed_scale", 1.0))


def _replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Puts `new` wherever `old` is attached in model (every parent and name)."""
    found = False
    for _, parent in model.named_modules(remove_duplicate=False):
        for name, child in list(parent.named_children()):
            if child is old:
                setattr(parent, name, new)
                found = True
    if not found:
        raise ValueError(f"{type(old).__name__} is not a submodule of the model")


def quantize_embeddings_(model: nn.Module, fmt: Union[str, Format], *,
                         layout: Union[None, str, Layout] = None) -> nn.Module:
    """Quantizes the model's input embedding (model.get_input_embeddings(), an nn.Embedding) into a
    QuantEmbedding, and its LM head (model.get_output_embeddings(), an nn.Linear) into a QuantLinear:

    - head tied to the embedding (the same weight tensor, e.g. SmolLM2, tie_word_embeddings=True):
      the head shares the embedding's packed buffers (one copy in memory and in checkpoints);
    - untied head: quantized separately, from its own weight, in the same format and layout;
    - no head (or already quantized): only the embedding.

    layout: default the device's default for the format (q8_0 on CPU: lut8_i8_n16). In place;
    returns model. Run it before or after quantize_ (which skips the head by default)."""
    fmt = _row_format(fmt)
    if not hasattr(model, "get_input_embeddings"):
        raise TypeError("quantize_embeddings_ needs a model with get_input_embeddings() (a transformers "
                        "PreTrainedModel); for another model use QuantEmbedding.from_embedding directly")
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        raise ValueError("quantize_embeddings_: the input embedding is already quantized")
    if not isinstance(emb, nn.Embedding):
        raise TypeError(f"quantize_embeddings_: the input embedding is a {type(emb).__name__}, not nn.Embedding")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = isinstance(head, nn.Linear) and head.weight is emb.weight
    qemb = QuantEmbedding.from_embedding(emb, fmt, layout=layout)
    if isinstance(head, nn.Linear):
        qhead = qemb.tied_head(head.bias) if tied else QuantLinear.from_linear(head, fmt, layout=qemb.layout)
        _replace_module(model, head, qhead)
    _replace_module(model, emb, qemb)
    return model
