"""Q-Palette formats: incoherence processing, then a quantizer built for the standard Gaussian.

Every member does the same around its own codebook (Q-Palette, QuIP#):
1. Rotate along the input dimension: W' = (W * s) @ H (random signs s from `seed`, normalized
   Hadamard H, torch_lowbit/rotations). Activations get the same rotation online (x' = (x * s) @ H),
   so x' @ W'^T = x @ W^T. Layers of one input (q/k/v, gate/up) fused into one module share it.
2. Divide each output row by its RMS: rows of W' are close to i.i.d. N(0, σ_row²).
3. Quantize the unit-variance rows with the format's codebook (NUQ, VQ, TCQ: subclasses).
4. Refit each row's scale by least squares on the chosen codes (the best scale for those codes),
   stored in fp16 [out_features].

The reference dequantizer undoes it: W = ((decode(codes) * row_scale) @ H^T) * s.
Stored per layer: the codes, row_scales [N] fp16 and signs [K] int8 (the rotation, saved so that
checkpoints never depend on a random generator). Bits per weight count the codes; the row scale
adds 16 / in_features (0.03 at K = 576) and the signs 8 / out_features.
"""
from __future__ import annotations

import dataclasses
from abc import abstractmethod
from typing import ClassVar, Optional

import torch
from torch import Tensor

from ..rotations import hadamard_transform, random_signs, supported_hadamard_size
from . import tcq
from .base import Format
from .palette_codebooks import nuq_levels, vq_codebook, vq_entries, NUQ_BITS, VQ_BITS
from .registry import register_format


@dataclasses.dataclass(frozen=True)
class PaletteFormat(Format):
    bits: float
    rotate: bool = True  # incoherence processing; False quantizes W as is (for ablations)
    seed: int = 0  # of the rotation's random signs

    prefix: ClassVar[str]
    supported_bits: ClassVar[tuple]
    columns: ClassVar[int]  # in_features must be a multiple of this (weights per code, TCQ tiles)
    layout_family: ClassVar[str] = "palette"
    row_multiple: ClassVar[int] = 1  # out_features must be a multiple of this (TCQ tiles)

    def __post_init__(self):
        if not any(self.bits == b for b in self.supported_bits):
            raise ValueError(f"{self.prefix}: bits must be one of {[float(b) for b in self.supported_bits]}, "
                             f"got {self.bits}")

    @property
    def group_size(self) -> int:
        return self.columns

    @property
    def name(self) -> str:
        return (f"{self.prefix}{self.bits:g}{self.variant}" + ("" if self.rotate else "_norot")
                + (f"_s{self.seed}" if self.seed else ""))

    @property
    def variant(self) -> str:
        """Name suffix of a codebook variant (TCQ's computed code: "_1mad")."""
        return ""

    def bits_per_weight(self) -> float:
        return float(self.bits)

    # -- the codebook: subclasses -------------------------------------------------------------
    @abstractmethod
    def encode_unit(self, x: Tensor) -> dict[str, Tensor]:
        """Codes for fp32 rows x [N, K] of unit variance (the format's nearest / Viterbi rounding)."""

    @abstractmethod
    def decode_unit(self, q: dict[str, Tensor]) -> Tensor:
        """fp32 [N, K]: the values the codes stand for before the row scale (any fixed unit)."""

    @abstractmethod
    def code_shapes(self, out_features: int, in_features: int) -> dict[str, tuple]:
        """name -> (shape, dtype) of the code tensors encode_unit returns."""

    @abstractmethod
    def decode_tables(self) -> dict[str, Tensor]:
        """The constant tables decode_unit reads (codebook / state values). Layouts keep them as
        module buffers and pass them in with the codes, so a compiled forward never loads files."""

    def unit_scale(self) -> float:
        """decode_unit(encode_unit(x)) * unit_scale() approximates x (unit variance in, same out)."""
        return 1.0

    def _table(self, q: dict[str, Tensor], name: str, device) -> Tensor:
        t = q.get(name)
        return t if t is not None else self.decode_tables()[name].to(device)

    # -- shared ---------------------------------------------------------------------------------
    def shape_problem(self, out_features: int, in_features: int) -> Optional[str]:
        problem = super().shape_problem(out_features, in_features)
        if problem is None and out_features % self.row_multiple:
            problem = (f"has out_features={out_features}, not a multiple of {self.row_multiple} (the format's "
                       "tiles); exclude this layer with filter_fn")
        if problem is None and self.rotate and not supported_hadamard_size(in_features):
            problem = (f"has in_features={in_features}, which has no Hadamard transform (sizes k * 2^m, see "
                       "torch_lowbit.rotations); exclude the layer with filter_fn or use rotate=False")
        return problem

    def signs(self, in_features: int) -> Tensor:
        return random_signs(in_features, self.seed)

    def quantize(self, weight: Tensor, importance: Optional[Tensor] = None) -> dict[str, Tensor]:
        self.check_weight(weight)
        if importance is not None:
            raise ValueError(f"{self.name}: per-feature importance does not survive the rotation; "
                             "use Hessian-based rounding (rounding='gptq') or plain rounding")
        w = self.rotate_weight(weight)
        rms = w.pow(2).mean(1, keepdim=True).sqrt()
        q = self.encode_unit(w / torch.where(rms > 0, rms, torch.ones_like(rms)))
        return self.finish(w, q)

    def rotate_weight(self, weight: Tensor) -> Tensor:
        """fp32 W' = (W * s) @ H (or W itself without rotation)."""
        w = weight.detach().float()
        return hadamard_transform(w, self.signs(w.shape[1]).to(w.device)) if self.rotate else w

    def finish(self, w: Tensor, q: dict[str, Tensor]) -> dict[str, Tensor]:
        """Adds the least-squares row scales (for rotated weight w) and the signs to codes q."""
        unit = self.decode_unit(q)
        den = (unit * unit).sum(1)
        scale = torch.where(den > 0, (w * unit).sum(1) / den.clamp_min(1e-30), torch.zeros_like(den))
        q = dict(q, row_scales=scale.half())
        if self.rotate:
            q["signs"] = self.signs(w.shape[1]).to(device=w.device, dtype=torch.int8)
        return q

    def dequantize_rotated(self, q: dict[str, Tensor]) -> Tensor:
        """fp32 W' as the codes give it, still in the rotated basis (what kernels multiply x' with)."""
        return scale_rows(self.decode_unit(q), q["row_scales"])

    def dequantize(self, q: dict[str, Tensor]) -> Tensor:
        w = self.dequantize_rotated(q)
        if self.rotate:
            w = hadamard_transform(w, q["signs"].float(), inverse=True)
        return w

    def rotate_activations(self, x: Tensor, signs: Optional[Tensor]) -> Tensor:
        """x' = (x * s) @ H, in x's dtype (identity without rotation)."""
        return hadamard_transform(x, signs.to(torch.float32)) if self.rotate else x

    def buffer_shapes(self, out_features: int, in_features: int) -> dict[str, tuple]:
        shapes = dict(self.code_shapes(out_features, in_features))
        shapes["row_scales"] = ((out_features,), torch.float16)
        if self.rotate:
            shapes["signs"] = ((in_features,), torch.int8)
        return shapes


@dataclasses.dataclass(frozen=True)
class NUQ(PaletteFormat):
    """nuq{b}: one code per weight, the b-bit Lloyd-Max levels of N(0, 1) on an int8 grid.

    The levels are rounded to integers t = round(127 * level / max level) (error ~1e-5 of the
    signal, far below the b-bit distortion) and a code decodes to t[code] itself (the row scale
    carries the rest), so the int8-activation kernels run the format exactly."""

    kind: ClassVar[str] = "nuq"
    prefix: ClassVar[str] = "nuq"
    layout_family: ClassVar[str] = "nuq"  # int8-table kernels on CPU (nuq_i8_n16), palette_dense elsewhere
    supported_bits: ClassVar[tuple] = NUQ_BITS
    columns: ClassVar[int] = 1

    @property
    def code_bits(self) -> int:
        return int(self.bits)

    def code_values(self) -> Tensor:
        """fp32 integers [2^bits], ascending: the int8 table kernels look codes up in."""
        levels = nuq_levels(int(self.bits))
        return torch.round(levels * 127 / levels.max())

    def unit_scale(self) -> float:
        return float(nuq_levels(int(self.bits)).max()) / 127  # table units -> unit variance

    def encode_unit(self, x: Tensor) -> dict[str, Tensor]:
        t = self.code_values().to(x.device)
        return {"codes": torch.bucketize(x / self.unit_scale(), (t[1:] + t[:-1]) / 2).to(torch.uint8)}

    def decode_tables(self) -> dict[str, Tensor]:
        return {"nuq_table": self.code_values()}

    def decode_unit(self, q: dict[str, Tensor]) -> Tensor:
        return codebook_decode(q["codes"], self._table(q, "nuq_table", q["codes"].device))

    def code_shapes(self, out_features: int, in_features: int) -> dict[str, tuple]:
        return {"codes": ((out_features, in_features), torch.uint8)}


# The integer grid of the 2-D codebooks small enough for the int8 table kernels (<= 16 entries):
# |t| <= 64 keeps AVX2 on its unsigned dot product (table + offset <= 128, no sign trick).
VQ_INT_GRID = 64


@dataclasses.dataclass(frozen=True)
class VQ(PaletteFormat):
    """vq{b}: one code per pair of consecutive weights, the nearest of 2^(2b) points of a 2-D
    k-means codebook of the standard Gaussian.

    Codebooks of at most 16 points (vq1.5, vq2: 3- and 4-bit codes) are rounded to integers
    t = round(64 * point / max |coordinate|), as NUQ's levels are, so the int8-table kernels
    (layout vq_i8_n16) run them exactly; larger ones stay fp32 (palette_packed)."""

    kind: ClassVar[str] = "vq"
    prefix: ClassVar[str] = "vq"
    version: ClassVar[int] = 2  # 2: codebooks of <= 16 points on the integer grid
    supported_bits: ClassVar[tuple] = VQ_BITS
    columns: ClassVar[int] = 2

    @property
    def code_bits(self) -> int:
        return round(2 * self.bits)  # one code per pair: 2^(2b) entries

    @property
    def integer_codebook(self) -> bool:
        return self.code_bits <= 4

    def code_values(self) -> Tensor:
        """fp32 [2^(2b), 2]: what each code decodes to before the row scale (integers for <= 16 points)."""
        cb = vq_codebook(self.bits)
        return torch.round(cb * VQ_INT_GRID / cb.abs().max()) if self.integer_codebook else cb

    def unit_scale(self) -> float:
        cb = vq_codebook(self.bits)
        return float(cb.abs().max()) / VQ_INT_GRID if self.integer_codebook else 1.0

    def code_dtype(self) -> torch.dtype:
        return torch.uint8 if vq_entries(self.bits) <= 256 else torch.int16

    def encode_unit(self, x: Tensor) -> dict[str, Tensor]:
        cb = self.code_values().to(x.device) * self.unit_scale()
        pairs = x.reshape(-1, 2)
        c2 = (cb * cb).sum(1)
        codes = torch.empty(pairs.shape[0], dtype=torch.long, device=x.device)
        chunk = max(1024, (1 << 22) // cb.shape[0])
        for s in range(0, pairs.shape[0], chunk):
            codes[s:s + chunk] = (c2 - 2 * pairs[s:s + chunk] @ cb.T).argmin(1)
        return {"codes": codes.reshape(x.shape[0], x.shape[1] // 2).to(self.code_dtype())}

    def decode_tables(self) -> dict[str, Tensor]:
        return {"vq_codebook": self.code_values()}

    def decode_unit(self, q: dict[str, Tensor]) -> Tensor:
        return codebook_decode(q["codes"], self._table(q, "vq_codebook", q["codes"].device))

    def code_shapes(self, out_features: int, in_features: int) -> dict[str, tuple]:
        return {"codes": ((out_features, in_features // 2), self.code_dtype())}


def codebook_decode(codes: Tensor, table: Tensor) -> Tensor:
    """fp32 [N, K]: each code's codebook value (nuq: a 1-D table or [2^b, 1]; vq: [2^b, 2], a pair of
    features per code), before the row scale."""
    return table[codes.long()].reshape(codes.shape[0], -1)


def tcq_decode_tiles(codes: Tensor, state_values: Tensor, bits: float) -> Tensor:
    """fp32 [N, K] from TCQ codes int32 [N/16, K/16, 4 s] (a sequence per 16 x 16 tile) and the value of
    every state [2**L, 2], before the row scale."""
    n, k = codes.shape[0] * 16, codes.shape[1] * 16
    values = state_values[tcq.tcq_unpack_states(codes, bits).long()]
    return _untiles(values.reshape(codes.shape[0], -1), n, k)


def scale_rows(unit: Tensor, row_scales: Tensor) -> Tensor:
    """fp32 W' = the decoded values times each row's fp16 scale."""
    return unit * row_scales.float()[:, None]


def _tiles(x: Tensor) -> Tensor:
    """[N, K] -> [N/16, K/16 * 256]: each 16 x 16 tile flattened row-major into one TCQ sequence."""
    n, k = x.shape
    return x.reshape(n // 16, 16, k // 16, 16).permute(0, 2, 1, 3).reshape(n // 16, (k // 16) * 256)


def _untiles(seqs: Tensor, n: int, k: int) -> Tensor:
    return seqs.reshape(n // 16, k // 16, 16, 16).permute(0, 2, 1, 3).reshape(n, k)


@dataclasses.dataclass(frozen=True)
class TCQ(PaletteFormat):
    """tcq{b}: QTIP's bitshift trellis (L = 16, V = 2, tail-biting sequences of 256 weights), one
    sequence per 16 x 16 tile of W', Viterbi-encoded (torch_lowbit/formats/tcq.py holds the math and
    the packing). b in 1.5 .. 5 by 0.5. code "hyb": QTIP's hybrid quantlut_sym code (a table lookup per
    state); "1mad" (tcq{b}_1mad): a computed code, two multiply-adds per state, no table."""

    kind: ClassVar[str] = "tcq"
    prefix: ClassVar[str] = "tcq"
    row_multiple: ClassVar[int] = 16
    supported_bits: ClassVar[tuple] = tcq.TCQ_SUPPORTED_BITS
    columns: ClassVar[int] = 16
    code: str = "hyb"

    def __post_init__(self):
        super().__post_init__()
        if self.code not in tcq.TCQ_CODES:
            raise ValueError(f"{self.prefix}: code must be one of {list(tcq.TCQ_CODES)}, got {self.code!r}")

    @property
    def variant(self) -> str:
        return "" if self.code == "hyb" else f"_{self.code}"

    def unit_scale(self) -> float:
        return tcq.mad_unit_scale() if self.code == "1mad" else 1.0

    def encode_unit(self, x: Tensor) -> dict[str, Tensor]:
        return {"codes": tcq.tcq_encode(_tiles(x), self.bits, self.code)}

    def decode_tables(self) -> dict[str, Tensor]:
        if self.code == "1mad":  # in the code's own units (1/128), which the kernels compute
            return {"tcq_values": tcq.mad_code_values()}
        return {"tcq_values": tcq.tcq_state_values(self.bits)}

    def decode_unit(self, q: dict[str, Tensor]) -> Tensor:
        return tcq_decode_tiles(q["codes"], self._table(q, "tcq_values", q["codes"].device), self.bits)

    def code_shapes(self, out_features: int, in_features: int) -> dict[str, tuple]:
        return {"codes": ((out_features // 16, in_features // 16, 4 * tcq.tcq_shift_bits(self.bits)), torch.int32)}


@dataclasses.dataclass(frozen=True)
class HalfTCQ(PaletteFormat):
    """tcq{b} for b = 1.75, 2.25, .., 4.75 (Q-Palette's half-TCQ): the first half of the input
    features at b - 0.25 bits, the second at b + 0.25, each a TCQ code as above."""

    kind: ClassVar[str] = "tcq_half"
    prefix: ClassVar[str] = "tcq"
    row_multiple: ClassVar[int] = 16
    supported_bits: ClassVar[tuple] = tuple(b + 0.25 for b in tcq.TCQ_SUPPORTED_BITS[:-1])
    columns: ClassVar[int] = 32  # two halves of whole 16-column tiles
    code: str = "hyb"  # of both halves (TCQ's code)

    def __post_init__(self):
        super().__post_init__()
        self.halves()  # checks the code

    @property
    def variant(self) -> str:
        return self.halves()[0].variant

    def unit_scale(self) -> float:
        return self.halves()[0].unit_scale()

    def halves(self) -> tuple[TCQ, TCQ]:
        return TCQ(self.bits - 0.25, rotate=False, code=self.code), TCQ(self.bits + 0.25, rotate=False, code=self.code)

    def encode_unit(self, x: Tensor) -> dict[str, Tensor]:
        lo, hi = self.halves()
        h = x.shape[1] // 2
        return {"codes_lo": lo.encode_unit(x[:, :h].contiguous())["codes"],
                "codes_hi": hi.encode_unit(x[:, h:].contiguous())["codes"]}

    def decode_tables(self) -> dict[str, Tensor]:
        lo, hi = self.halves()
        return {"tcq_values_lo": lo.decode_tables()["tcq_values"], "tcq_values_hi": hi.decode_tables()["tcq_values"]}

    def decode_unit(self, q: dict[str, Tensor]) -> Tensor:
        lo, hi = self.halves()
        return torch.cat([lo.decode_unit({"codes": q["codes_lo"], "tcq_values": q.get("tcq_values_lo")}),
                          hi.decode_unit({"codes": q["codes_hi"], "tcq_values": q.get("tcq_values_hi")})], 1)

    def code_shapes(self, out_features: int, in_features: int) -> dict[str, tuple]:
        lo, hi = self.halves()
        h = in_features // 2
        return {"codes_lo": lo.code_shapes(out_features, h)["codes"], "codes_hi": hi.code_shapes(out_features, h)["codes"]}


for _b in NUQ_BITS:
    register_format(NUQ(bits=_b))
for _b in VQ_BITS:
    register_format(VQ(bits=_b))
for _b in tcq.TCQ_SUPPORTED_BITS:
    register_format(TCQ(bits=_b))
    register_format(TCQ(bits=_b, code="1mad"))
for _b in HalfTCQ.supported_bits:
    register_format(HalfTCQ(bits=_b))
    register_format(HalfTCQ(bits=_b, code="1mad"))
