"""gvq: general vector quantization VQ<x, y, z> (VQ-LLM's family): vectors of x = `vec` consecutive
input features, each coded by z = `residuals` codes of y = `entries_log2` bits, every code an entry of
its stage's codebook (2^y vectors of x fp16 values); the stages add up (residual / additive VQ).

    W'[n, x j : x j + x] = row_scale[n] * sum_r codebooks[region(n, j), r, codes[n, j, r]]
    W = W' without the rotation: ((W' H^T) * s) when rotate, else W'

Codebook scope (which weights share one codebook set):
- "tensor": one per layer (AQLM);
- "tile:RxC": one per tile of R output rows x C input features (GPTVQ: 256x256); ragged edge tiles
  are smaller;
- "channel-group:G": one per G input features, over all rows (the KV cache's CQ: one per channel group).

Named configurations: aqlm_1x16 <8, 16, 1>, aqlm_2x8 <8, 8, 2>, gptvq2 <4, 8, 1> per 256x256 tile;
others are gvq{x}x{y}[r{z}][_t{R}x{C} | _cg{G}][_had].

Quantization (pure torch, deterministic from `seed`): rotate (optional random-sign Hadamard, as the
palette formats), divide each row by its RMS, then per codebook region: k-means (weighted by the
per-feature importance when given) for stage 1, k-means of the residual for stage 2, then
`refine_iters` rounds of AQLM-style refinement: beam search over the stage codes (`beam` stage-1
candidates, each with its best stage 2) and a refit of each stage's entries as the weighted mean of
what it codes given the others. Codebooks are rounded to fp16 before the last code search, and row
scales are refit by least squares on the codes. With a Hessian (rounding="gptq"), the codebooks are
fixed first and block LDLQ picks the codes vector by vector (torch_lowbit/calibrate/ldlq.py).

Storage (storage_bits, exact): codes z y / x bits per weight, every codebook (16 bits per value), one
fp16 scale per row, and the int8 signs of the rotation. bits_per_weight() is its shape-free part
(codes, plus a tile's codebooks for the tile scope).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import ClassVar, Optional

import torch
from torch import Tensor

from ..rotations import hadamard_transform, random_signs, supported_hadamard_size
from .base import Format
from .registry import register_format

VECTOR_SIZES = (2, 4, 8)
ENTRY_BITS = range(4, 17)
RESIDUALS = (1, 2)
CODEBOOK_BITS = 16  # fp16 entries
_SCOPE = re.compile(r"^(tensor|tile:(\d+)x(\d+)|channel-group:(\d+))$")
_DISTANCE_BUDGET = 1 << 24  # floats of one distance block (vectors x entries) in the code search


def parse_scope(scope: str) -> tuple[int, int]:
    """(tile_rows, tile_cols) of a codebook scope; 0 stands for "all" (tensor: (0, 0))."""
    m = _SCOPE.match(scope.replace("×", "x")) if isinstance(scope, str) else None
    if not m:
        raise ValueError(f"gvq: codebook_scope must be 'tensor', 'tile:RxC' or 'channel-group:G', got {scope!r}")
    if m.group(1) == "tensor":
        return 0, 0
    if m.group(4) is not None:
        return 0, int(m.group(4))
    return int(m.group(2)), int(m.group(3))


def region_grid(tile_rows: int, tile_cols: int, out_features: int, in_features: int) -> tuple[int, int]:
    """(row tiles, column tiles) of the codebook regions of an [out, in] weight."""
    rows = -(-out_features // tile_rows) if tile_rows else 1
    cols = -(-in_features // tile_cols) if tile_cols else 1
    return rows, cols


def region_index(tile_rows: int, tile_cols: int, out_features: int, in_features: int, rows: Tensor,
                 features: Tensor) -> Tensor:
    """int64 [len(rows), len(features)]: the codebook region of the vectors that start at `features` in
    the given rows of an [out, in] weight (regions numbered row tile-major)."""
    _, col_tiles = region_grid(tile_rows, tile_cols, out_features, in_features)
    r = rows // tile_rows if tile_rows else torch.zeros_like(rows)
    c = features // tile_cols if tile_cols else torch.zeros_like(features)
    return r[:, None] * col_tiles + c[None, :]


def gather_values(codebooks: Tensor, region: Tensor, codes: Tensor) -> Tensor:
    """fp32 [N, nv * vec]: the sum over stages of each vector's entries (codes int [N, nv, z] in the
    codebooks [regions, z, 2^y, vec] of their region [N, nv])."""
    n, nv, z = codes.shape
    regions, _, entries, vec = codebooks.shape
    flat = codebooks.float().reshape(regions * z * entries, vec)
    stage = torch.arange(z, device=codes.device) * entries
    index = (region[..., None].to(codes.device) * (z * entries) + stage + codes.long()).reshape(-1)
    return flat[index].reshape(n, nv, z, vec).sum(2).reshape(n, nv * vec)


def decode_vectors(codes: Tensor, codebooks: Tensor, tile_rows: int, tile_cols: int) -> Tensor:
    """fp32 [N, K]: the reference decode before the row scale (codes int [N, K/vec, z], codebooks
    [regions, z, 2^y, vec] of scope (tile_rows, tile_cols))."""
    n, nv, _ = codes.shape
    vec = codebooks.shape[-1]
    dev = codes.device
    region = region_index(tile_rows, tile_cols, n, nv * vec, torch.arange(n, device=dev),
                          torch.arange(nv, device=dev) * vec)
    return gather_values(codebooks, region, codes)


@dataclasses.dataclass(frozen=True)
class GeneralVQ(Format):
    kind: ClassVar[str] = "gvq"
    layout_family: ClassVar[str] = "gvq"
    vec: int = 4  # x: features per vector
    entries_log2: int = 8  # y: bits per code, 2^y entries per codebook
    residuals: int = 1  # z: codes (stages) per vector
    codebook_scope: str = "tensor"
    rotate: bool = False  # random-sign Hadamard incoherence along the input features
    seed: int = 0  # of the k-means initialisation and the rotation's signs
    kmeans_iters: int = 12
    beam: int = 4  # stage-1 candidates the residual code search keeps (1: greedy)
    refine_iters: int = 2  # rounds of (beam-search codes, codebook refit) after k-means
    tune_steps: int = 100  # with a Hessian (LDLQ): Adam steps on the codebooks and row scales (AQLM's tuning)

    def __post_init__(self):
        if self.vec not in VECTOR_SIZES:
            raise ValueError(f"gvq: vec must be one of {VECTOR_SIZES}, got {self.vec}")
        if self.entries_log2 not in ENTRY_BITS:
            raise ValueError(f"gvq: entries_log2 must be {ENTRY_BITS.start}..{ENTRY_BITS.stop - 1} "
                             f"(2^y codebook entries), got {self.entries_log2}")
        if self.residuals not in RESIDUALS:
            raise ValueError(f"gvq: residuals must be 1 or 2, got {self.residuals}")
        rows, cols = parse_scope(self.codebook_scope)
        if self.codebook_scope != "tensor" and (cols <= 0 or cols % self.vec or rows < 0
                                                or (self.codebook_scope.startswith("tile") and rows <= 0)):
            raise ValueError(f"gvq: codebook_scope {self.codebook_scope!r} needs positive sizes and a feature "
                             f"count that is a multiple of vec={self.vec}")
        if self.kmeans_iters < 0 or self.beam < 1 or self.refine_iters < 0 or self.tune_steps < 0:
            raise ValueError("gvq: kmeans_iters, refine_iters and tune_steps must be >= 0 and beam >= 1")

    # -- identity -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        base = _PRESET_NAMES.get((self.vec, self.entries_log2, self.residuals, self.codebook_scope))
        if base is None:
            base = f"gvq{self.vec}x{self.entries_log2}" + (f"r{self.residuals}" if self.residuals > 1 else "")
            rows, cols = self.scope
            if self.codebook_scope.startswith("tile"):
                base += f"_t{rows}x{cols}"
            elif self.codebook_scope.startswith("channel-group"):
                base += f"_cg{cols}"
        return base + ("_had" if self.rotate else "") + (f"_s{self.seed}" if self.seed else "")

    @property
    def scope(self) -> tuple[int, int]:
        """(tile_rows, tile_cols): 0 = all rows / all features."""
        return parse_scope(self.codebook_scope)

    @property
    def group_size(self) -> int:
        return self.vec

    @property
    def entries(self) -> int:
        return 1 << self.entries_log2

    @property
    def code_bits_per_weight(self) -> float:
        return self.residuals * self.entries_log2 / self.vec

    def codebook_bits(self) -> int:
        """Bits of one region's codebooks (every stage)."""
        return self.residuals * self.entries * self.vec * CODEBOOK_BITS

    def bits_per_weight(self) -> float:
        """The shape-free part of the cost: code bits, plus the tile's codebooks for the tile scope
        (storage_bits(out, in) counts everything for a given layer)."""
        rows, cols = self.scope
        tile = self.codebook_bits() / (rows * cols) if rows and cols else 0.0
        return self.code_bits_per_weight + tile

    def regions(self, out_features: int, in_features: int) -> int:
        rows, cols = region_grid(*self.scope, out_features, in_features)
        return rows * cols

    def storage_bits(self, out_features: int, in_features: int) -> float:
        """Every stored bit of an [out, in] layer: codes, codebooks, row scales, rotation signs."""
        bits = out_features * in_features * self.code_bits_per_weight
        bits += self.regions(out_features, in_features) * self.codebook_bits() + 16 * out_features
        return bits + (8 * in_features if self.rotate else 0)

    def shape_problem(self, out_features: int, in_features: int) -> Optional[str]:
        if in_features % self.vec:
            return (f"has in_features={in_features}, not a multiple of the vector size {self.vec}; pick a "
                    "gvq format with a vec dividing it or exclude the layer with filter_fn")
        if self.rotate and not supported_hadamard_size(in_features):
            return (f"has in_features={in_features}, which has no Hadamard transform (sizes k * 2^m, see "
                    "torch_lowbit.rotations); use rotate=False or exclude the layer with filter_fn")
        return None

    def check_quantized(self, q: dict[str, Tensor], out_features: int, in_features: int, *,
                        codes_as_row_bytes: bool = False) -> None:
        super().check_quantized(q, out_features, in_features, codes_as_row_bytes=codes_as_row_bytes)
        want = self.tensor_shapes(out_features, in_features)
        for key, (shape, _) in want.items():
            t = q.get(key)
            if t is None or tuple(t.shape) != shape:
                raise ValueError(f"{self.name}: {key} must have shape {shape} for a {out_features}x{in_features} "
                                 f"weight, got {None if t is None else tuple(t.shape)} (a codebook or code "
                                 "tensor of another configuration?)")
        codes = q["codes"]
        if codes.is_floating_point() or (codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.entries)):
            raise ValueError(f"{self.name}: codes must be integers in [0, {self.entries})")
        if not bool(torch.isfinite(q["codebooks"].float()).all()):
            raise ValueError(f"{self.name}: codebooks hold NaN/Inf")

    def tensor_shapes(self, out_features: int, in_features: int) -> dict[str, tuple]:
        """name -> (shape, dtype) of what quantize() returns."""
        shapes = {"codes": ((out_features, in_features // self.vec, self.residuals), torch.int32),
                  "codebooks": ((self.regions(out_features, in_features), self.residuals, self.entries, self.vec),
                                torch.float16),
                  "row_scales": ((out_features,), torch.float16)}
        if self.rotate:
            shapes["signs"] = ((in_features,), torch.int8)
        return shapes

    # -- the reference dequantizer --------------------------------------------------------------
    def dequantize_rotated(self, q: dict[str, Tensor]) -> Tensor:
        """fp32 W' (still in the rotated basis: what kernels multiply the rotated x with)."""
        unit = decode_vectors(q["codes"], q["codebooks"], *self.scope)
        return unit * q["row_scales"].float()[:, None]

    def dequantize(self, q: dict[str, Tensor]) -> Tensor:
        w = self.dequantize_rotated(q)
        return hadamard_transform(w, q["signs"].float(), inverse=True) if self.rotate else w

    def rotate_activations(self, x: Tensor, signs: Optional[Tensor]) -> Tensor:
        return hadamard_transform(x, signs.to(torch.float32)) if self.rotate else x

    def signs(self, in_features: int) -> Tensor:
        return random_signs(in_features, self.seed)

    def rotate_weight(self, weight: Tensor) -> Tensor:
        w = weight.detach().float()
        return hadamard_transform(w, self.signs(w.shape[1]).to(w.device)) if self.rotate else w

    # -- quantization ---------------------------------------------------------------------------
    def quantize(self, weight: Tensor, importance: Optional[Tensor] = None) -> dict[str, Tensor]:
        self.check_weight(weight)
        fixed = self.fixed_parameters(weight, importance)
        w = self.rotate_weight(weight)
        codes = self._search(fixed, w / fixed["rms"], torch.arange(w.shape[0], device=w.device), 0)
        return self.finish(w, codes, fixed["codebooks"])

    def fixed_parameters(self, weight: Tensor, importance: Optional[Tensor] = None) -> dict[str, Tensor]:
        """What stays fixed while codes are chosen: the row RMS (fp32 [N, 1]) and the fp16 codebooks
        learned on the RMS-normalized rows (k-means, residual k-means, refinement)."""
        w = self.rotate_weight(weight)
        n, k = w.shape
        if importance is not None:
            if self.rotate:
                raise ValueError(f"{self.name}: per-feature importance does not survive the rotation; use "
                                 "rounding='gptq' or rotate=False")
            if importance.shape != (k,) or not bool(torch.isfinite(importance).all()) or bool((importance < 0).any()):
                raise ValueError(f"{self.name}: importance must be {k} finite non-negative values")
            imp = importance.detach().float().to(w.device)
            importance = imp / imp.mean().clamp_min(1e-30) + 1e-6
        rms = w.pow(2).mean(1, keepdim=True).sqrt()
        rms = torch.where(rms > 0, rms, torch.ones_like(rms))
        u = w / rms
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        rows, cols = self.scope
        row_tiles, col_tiles = region_grid(rows, cols, n, k)
        books = torch.empty(row_tiles * col_tiles, self.residuals, self.entries, self.vec)
        for ri in range(row_tiles):
            r0, r1 = (ri * rows, min(n, ri * rows + rows)) if rows else (0, n)
            for ci in range(col_tiles):
                c0, c1 = (ci * cols, min(k, ci * cols + cols)) if cols else (0, k)
                x = u[r0:r1, c0:c1].reshape(-1, self.vec)
                wt = None if importance is None else importance[c0:c1].reshape(1, -1).expand(r1 - r0, -1).reshape(-1, self.vec)
                books[ri * col_tiles + ci] = self._learn(x, wt, gen).cpu()
        return {"rms": rms, "codebooks": books.half().to(w.device), "shape": torch.tensor([n, k])}

    def _learn(self, x: Tensor, wt: Optional[Tensor], gen: torch.Generator) -> Tensor:
        """fp32 [z, 2^y, vec]: one region's stage codebooks for vectors x [M, vec]."""
        stages = []
        residual = x
        for _ in range(self.residuals):
            book = kmeans(residual, wt, self.entries, self.kmeans_iters, gen)
            stages.append(book)
            residual = residual - book[nearest(residual, wt, book)]
        books = torch.stack(stages)
        for _ in range(self.refine_iters if self.residuals > 1 else 0):
            codes = beam_search(x, wt, books, self.beam)
            books = refit(x, wt, books, codes)
        return books

    def _regions(self, fixed: dict[str, Tensor], rows: Tensor, col0: int, count: int) -> Tensor:
        """Regions [len(rows), count] of `count` vectors from feature col0 on (the layer's size is read
        from the fixed parameters: N rows, K features)."""
        n, k = fixed["shape"].tolist()
        features = col0 + torch.arange(count, device=rows.device) * self.vec
        return region_index(*self.scope, n, k, rows, features)

    def _search(self, fixed: dict[str, Tensor], u: Tensor, rows: Tensor, col0: int) -> Tensor:
        """int32 codes [len(rows), cols / vec, z] of normalized weights u (rows `rows`, features from col0)
        against the fixed fp16 codebooks, each vector searched in its own region's codebooks."""
        books = fixed["codebooks"].float()
        nv = u.shape[1] // self.vec
        region = self._regions(fixed, rows, col0, nv)
        codes = torch.empty(u.shape[0], nv, self.residuals, dtype=torch.int32, device=u.device)
        vectors = u.reshape(u.shape[0], nv, self.vec)
        for r in torch.unique(region).tolist():
            mask = region == r
            codes[mask] = beam_search(vectors[mask], None, books[r], self.beam).int()
        return codes

    def finish(self, w: Tensor, codes: Tensor, codebooks: Tensor) -> dict[str, Tensor]:
        """The quantized tensors of rotated weight w: codes, codebooks, least-squares row scales, signs."""
        unit = decode_vectors(codes, codebooks, *self.scope)
        den = (unit * unit).sum(1)
        scale = torch.where(den > 0, (w * unit).sum(1) / den.clamp_min(1e-30), torch.zeros_like(den))
        q = {"codes": codes, "codebooks": codebooks, "row_scales": scale.half()}
        if self.rotate:
            q["signs"] = self.signs(w.shape[1]).to(device=w.device, dtype=torch.int8)
        return q

    # -- block LDLQ (rounding="gptq"): torch_lowbit/calibrate/ldlq.py ------------------------------
    def ldlq_coder(self, weight: Tensor, hessian: Tensor):
        """(rotated fp32 W', width, encode(c0, cols [N, width]) -> (codes, values), finish(W', codes))
        for block LDLQ against the rotated Hessian: codebooks and row RMS fixed first (k-means weighted
        by the Hessian's diagonal), then each vector coded from its updated values; at the end the
        codebooks and row scales are tuned on the Hessian (tune_steps)."""
        w = self.rotate_weight(weight)
        fixed = dataclasses.replace(self, rotate=False).fixed_parameters(w, torch.diag(hessian).clamp_min(0))
        rows = torch.arange(w.shape[0], device=w.device)

        def encode(c0: int, cols: Tensor) -> tuple[Tensor, Tensor]:
            codes = self._search(fixed, cols / fixed["rms"], rows, c0)
            values = gather_values(fixed["codebooks"], self._regions(fixed, rows, c0, codes.shape[1]), codes)
            return codes, values * fixed["rms"]

        def finish(w0: Tensor, codes: list[Tensor]) -> dict[str, Tensor]:
            q = self.finish(w0, torch.cat(codes, 1), fixed["codebooks"])
            return self.tune(q, w0, hessian) if self.tune_steps else q

        return w, self.vec, encode, finish

    def tune(self, q: dict[str, Tensor], w: Tensor, hessian: Tensor, lr: float = 2e-3) -> dict[str, Tensor]:
        """q with its codebooks and row scales tuned by Adam (codes fixed) to lower the output error
        tr((W' - Q) H (W' - Q)^T) of rotated weight w under the rotated Hessian: AQLM's codebook
        tuning. Kept only where it lowers the error of the fp16-rounded result."""
        h = hessian.float()
        norm = torch.einsum("ij,jk,ik->", w, h, w).clamp_min(1e-30)

        def error(books: Tensor, scales: Tensor) -> Tensor:
            d = decode_vectors(q["codes"], books, *self.scope) * scales[:, None] - w
            return torch.einsum("ij,jk,ik->", d, h, d) / norm

        books = q["codebooks"].float().clone().requires_grad_(True)
        scales = q["row_scales"].float().clone().requires_grad_(True)
        opt = torch.optim.Adam([books, scales], lr=lr)
        with torch.enable_grad():
            for _ in range(self.tune_steps):
                loss = error(books, scales)
                opt.zero_grad()
                loss.backward()
                opt.step()
        tuned = dict(q, codebooks=books.detach().half(), row_scales=scales.detach().half())
        with torch.no_grad():
            before = error(q["codebooks"].float(), q["row_scales"].float())
            after = error(tuned["codebooks"].float(), tuned["row_scales"].float())
        return tuned if bool(torch.isfinite(after)) and after < before else q


# -- k-means and the code search (shared by every region and by the KV cache's codebooks) ------------

def _distances(x: Tensor, wt: Optional[Tensor], book: Tensor) -> Tensor:
    """[M, E] (weighted) squared distances of vectors x [M, d] to entries book [E, d], up to a per-row
    constant (sum w x^2 is dropped: it does not change any argmin)."""
    if wt is None:
        return (book * book).sum(1)[None, :] - 2 * x @ book.T
    return wt @ (book * book).T - 2 * (wt * x) @ book.T


def nearest(x: Tensor, wt: Optional[Tensor], book: Tensor) -> Tensor:
    """int64 [M]: each vector's nearest entry."""
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    step = max(1, _DISTANCE_BUDGET // book.shape[0])
    for s in range(0, x.shape[0], step):
        out[s:s + step] = _distances(x[s:s + step], None if wt is None else wt[s:s + step], book).argmin(1)
    return out


def kmeans(x: Tensor, wt: Optional[Tensor], entries: int, iters: int, gen: torch.Generator) -> Tensor:
    """fp32 [entries, d]: Lloyd's k-means of x [M, d] (weighted per coordinate by wt). With fewer
    vectors than entries the codebook is the vectors themselves (padded by repeats): exact."""
    m, d = x.shape
    if m <= entries:
        pick = torch.arange(entries) % max(m, 1)
        return x[pick.to(x.device)].clone() if m else x.new_zeros(entries, d)
    book = x[torch.randperm(m, generator=gen)[:entries].to(x.device)].clone()
    ones = torch.ones_like(x) if wt is None else wt
    for _ in range(iters):
        codes = nearest(x, wt, book)
        sums = torch.zeros_like(book).index_add_(0, codes, ones * x)
        mass = torch.zeros_like(book).index_add_(0, codes, ones)
        book = torch.where(mass > 0, sums / mass.clamp_min(1e-30), book)
    return book


def beam_search(x: Tensor, wt: Optional[Tensor], books: Tensor, beam: int) -> Tensor:
    """int64 [M, z]: codes of x [M, d] in stage codebooks books [z, E, d] (z = 1: the nearest entry;
    z = 2: the best pair among the `beam` stage-1 entries nearest to x, each with its best stage 2)."""
    if books.shape[0] == 1:
        return nearest(x, wt, books[0])[:, None]
    b1, b2 = books[0], books[1]
    beam = min(beam, b1.shape[0])
    out = torch.empty(x.shape[0], 2, dtype=torch.long, device=x.device)
    step = max(1, _DISTANCE_BUDGET // (b1.shape[0] * beam))
    for s in range(0, x.shape[0], step):
        xs = x[s:s + step]
        ws = None if wt is None else wt[s:s + step]
        first = _distances(xs, ws, b1).topk(beam, dim=1, largest=False).indices  # [m, beam]
        rest = (xs[:, None, :] - b1[first]).reshape(-1, xs.shape[1])  # [m * beam, d]
        wr = None if ws is None else ws.repeat_interleave(beam, 0)
        second = nearest(rest, wr, b2)
        err = rest - b2[second]
        err = (err * err if wr is None else wr * err * err).sum(1).reshape(-1, beam)
        best = err.argmin(1)
        out[s:s + step, 0] = first.gather(1, best[:, None])[:, 0]
        out[s:s + step, 1] = second.reshape(-1, beam).gather(1, best[:, None])[:, 0]
    return out


def refit(x: Tensor, wt: Optional[Tensor], books: Tensor, codes: Tensor) -> Tensor:
    """Each stage's entries refit (stage by stage) as the weighted mean of what they code given the other
    stages' values: block coordinate descent on the squared error; unused entries kept."""
    books = books.clone()
    ones = torch.ones_like(x) if wt is None else wt
    for r in range(books.shape[0]):
        others = sum(books[o][codes[:, o]] for o in range(books.shape[0]) if o != r)
        target = x - others
        sums = torch.zeros_like(books[r]).index_add_(0, codes[:, r], ones * target)
        mass = torch.zeros_like(books[r]).index_add_(0, codes[:, r], ones)
        books[r] = torch.where(mass > 0, sums / mass.clamp_min(1e-30), books[r])
    return books


# Named configurations of the literature: (vec, entries_log2, residuals, scope) -> name.
PRESETS = {
    "aqlm_1x16": dict(vec=8, entries_log2=16, residuals=1, codebook_scope="tensor"),
    "aqlm_2x8": dict(vec=8, entries_log2=8, residuals=2, codebook_scope="tensor"),
    "gptvq2": dict(vec=4, entries_log2=8, residuals=1, codebook_scope="tile:256x256"),
}
_PRESET_NAMES = {(p["vec"], p["entries_log2"], p["residuals"], p["codebook_scope"]): name for name, p in PRESETS.items()}

for _params in PRESETS.values():
    register_format(GeneralVQ(**_params))
# with the random-sign Hadamard rotation: on SmolLM2 it cuts block-LDLQ's output error 1.1-10x
# (docs/formats/gvq.md)
register_format(GeneralVQ(vec=8, entries_log2=8, residuals=2, rotate=True))
register_format(GeneralVQ(vec=4, entries_log2=8, rotate=True))
for _vec, _bits, _res in ((4, 8, 1), (2, 8, 1), (4, 8, 2), (8, 12, 2)):
    register_format(GeneralVQ(vec=_vec, entries_log2=_bits, residuals=_res))
