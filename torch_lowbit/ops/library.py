"""The torch_lowbit custom ops: every schema and the CPU kernels come from the C++ extension (the op
table in csrc/ops.cpp); here they get fake implementations (shape/dtype validation for torch.compile
and meta tensors), their CUDA implementations (Triton kernels) and the Python CPU impls of the ops
with no C++ kernel."""
from __future__ import annotations

import functools

import torch

from ..act_codes import ACT_BITS, KERNEL_ACT_BLOCKS, SUB_BLOCKS, dequantize_act_codes, quantize_act_codes
from ..tcq_codes import kernel_table_shape

_FLOAT_ACTS = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU's model name (for benchmark rows and test reports)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def cpu_extension():
    try:
        from .. import _C
    except ImportError as e:  # pragma: no cover - only on a broken install
        raise ImportError("torch_lowbit's C++ extension is not built; reinstall with "
                          "`pip install --no-build-isolation -e .` after installing torch") from e
    running = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if _C.built_torch_version() != running:  # the C++ ABI changes between torch minor releases
        raise ImportError(f"torch_lowbit's C++ extension was built against torch {_C.built_torch_version()}, but torch "
                          f"{torch.__version__} is installed: install torch=={_C.built_torch_version()}.* or rebuild "
                          "torch_lowbit against this torch (`pip install --no-build-isolation -e .`)")
    return _C


def _check(cond: bool, msg: str) -> None:
    torch._check(cond, lambda: msg)


def _lut4_check(qweight, scales, mins, lut, group_size):
    _check(qweight.dtype == torch.uint8 and qweight.dim() == 2, "lut4: qweight must be 2-D uint8 [N, K/2]")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    _check(group_size > 0 and group_size % 32 == 0 and k % group_size == 0,
           f"lut4: group size {group_size} must be a multiple of 32 dividing K={k}")
    _check(scales.dtype == torch.float16 and tuple(scales.shape) == (n, k // group_size),
           f"lut4: scales must be fp16 [{n}, {k // group_size}]")
    if mins is not None:
        _check(mins.dtype == torch.float16 and mins.shape == scales.shape, "lut4: mins must match scales")
    _check(lut.dtype == torch.float32 and lut.numel() == 16, "lut4: lut must be 16 fp32 values")
    return n, k


def _linear_out(op, x, n, k, bias):
    """The checks every fused linear op makes on its activations and bias; its (fake) output."""
    _check(x.dtype in _FLOAT_ACTS, f"{op}: x must be fp32/bf16/fp16, got {x.dtype}")
    _check(x.shape[-1] == k, f"{op}: x has {x.shape[-1]} features, weight has K={k}")
    if bias is not None:
        _check(bias.dim() == 1 and bias.shape[0] == n, f"{op}: bias must have {n} elements")
    return x.new_empty((*x.shape[:-1], n))


def _codebook_check(codes, code_bits, table, row_scales, in_features):
    """palette_packed nuq/vq codes: 16 interleaved bit streams per row (csrc/common/palette.h)."""
    _check(1 <= code_bits <= 12, f"codebook: code_bits must be 1..12, got {code_bits}")
    _check(table.dtype == torch.float32 and table.dim() == 2 and table.shape[0] == 2 ** code_bits
           and table.shape[1] in (1, 2), "codebook: table must be fp32 [2^code_bits, 1 or 2]")
    d = table.shape[1]
    _check(in_features % d == 0, f"codebook: in_features {in_features} must be a multiple of {d}")
    per_stream = -(-(in_features // d) // 16)
    words = 16 * -(-per_stream * code_bits // 32)
    _check(codes.dtype == torch.int32 and codes.dim() == 2 and codes.shape[1] == words,
           f"codebook: codes must be int32 [N, {words}]")
    n = codes.shape[0]
    _check(row_scales.dtype == torch.float16 and tuple(row_scales.shape) == (n,), f"codebook: row_scales must be fp16 [{n}]")
    return n, in_features


def _check_act_args(op, act_bits, act_block):
    _check(act_bits in (0, 8, 4, 3, 2), f"{op}: act_bits must be 0, 8, 4, 3 or 2, got {act_bits}")
    _check(act_block == 0 or (act_block in KERNEL_ACT_BLOCKS and act_bits != 0),
           f"{op}: act_block must be 0 (one scale per token) or one of {KERNEL_ACT_BLOCKS} (with act_bits), got {act_block}")
    _check(act_block not in SUB_BLOCKS or act_bits <= 4,
           f"{op}: act_block {act_block} needs act_bits <= 4, got {act_bits}: use act_block 32 or 0")


def _tcq_check(codes, table, table_bits, shift_bits, row_scales):
    _check(3 <= shift_bits <= 10, f"tcq: shift_bits must be 3..10, got {shift_bits}")
    _check(0 <= table_bits <= 15 and table.dtype == torch.float32
           and tuple(table.shape) == kernel_table_shape(table_bits),
           "tcq: table must be the fp32 signed table [2^(table_bits+1), 2] (table_bits 0: the 1mad code, [0, 2])")
    _check(codes.dtype == torch.int32 and codes.dim() == 3 and codes.shape[2] == 4 * shift_bits,
           f"tcq: codes must be int32 [N/16, K/16, {4 * shift_bits}]")
    n, k = codes.shape[0] * 16, codes.shape[1] * 16
    _check(row_scales.dtype == torch.float16 and tuple(row_scales.shape) == (n,), f"tcq: row_scales must be fp16 [{n}]")
    return n, k


def _stream_check(op, codes, code_bits, n, k):
    words = -(-k * code_bits // 32)
    _check(codes.dtype == torch.int32 and tuple(codes.shape) == (n, words),
           f"{op}: codes must be int32 [{n}, {words}] (one {code_bits}-bit MSB-first stream per row)")


def _lowbit_check(codes, code_bits, scales, mins, lut, group_size):
    """lowbit_rowmajor (int1/2/3): one code stream per row, fp16 group scales (and mins)."""
    _check(1 <= code_bits <= 3 or code_bits == 8, f"lowbit: code_bits must be 1..3 or 8, got {code_bits}")
    _check(group_size > 0 and group_size % 32 == 0, f"lowbit: group size {group_size} must be a multiple of 32")
    _check(scales.dtype == torch.float16 and scales.dim() == 2, "lowbit: scales must be 2-D fp16 [N, K/group]")
    n, k = scales.shape[0], scales.shape[1] * group_size
    if mins is not None:
        _check(mins.dtype == torch.float16 and mins.shape == scales.shape, "lowbit: mins must match scales")
    _check(lut.dtype == torch.float32 and lut.numel() == 2 ** code_bits,
           f"lowbit: lut must be {2 ** code_bits} fp32 values")
    _stream_check("lowbit", codes, code_bits, n, k)
    return n, k


def _gcb_check(codes, code_bits, sub_groups, super_scales, codebooks):
    """gcb_rowmajor: one code stream per row, sub-group bytes, superblock scales, int8 codebooks."""
    _check(code_bits in (2, 3), f"gcb: code_bits must be 2 or 3, got {code_bits}")
    _check(sub_groups.dtype == torch.uint8 and sub_groups.dim() == 2, "gcb: sub_groups must be 2-D uint8 [N, K/32]")
    n, k = sub_groups.shape[0], sub_groups.shape[1] * 32
    _check(super_scales.dtype == torch.float16 and super_scales.dim() == 2 and super_scales.shape[0] == n
           and super_scales.shape[1] > 0 and k % super_scales.shape[1] == 0
           and (k // super_scales.shape[1]) % 32 == 0,
           f"gcb: super_scales must be fp16 [{n}, K/superblock], the superblock a multiple of 32 dividing K={k}")
    _check(codebooks.dtype == torch.int8 and codebooks.dim() == 2 and codebooks.shape[1] == 2 ** code_bits
           and 1 <= codebooks.shape[0] <= 16, f"gcb: codebooks must be int8 [1..16, {2 ** code_bits}]")
    _stream_check("gcb", codes, code_bits, n, k)
    return n, k


def _dense_linear(op, x, w, bias):
    """The portable CPU impl of a fused linear op: the reference-decoded weight, a float matmul."""
    _linear_out(op, x, w.shape[0], w.shape[1], bias)
    return torch.nn.functional.linear(x.float(), w, bias.float() if bias is not None else None).to(x.dtype)


_CHECKS = {"lut4": _lut4_check, "tcq": _tcq_check, "lowbit": _lowbit_check, "gcb": _gcb_check}


def register_reference_cpu_impls(name: str, decode) -> None:
    """CPU impls of the Python-defined <name>_dequantize / <name>_linear (lowbit, gcb): the weights
    checked, then decode(in_features, *weights) -> fp32 [N, K] (the format's reference decoder, handed
    in by the layout that owns the op, so this bottom layer imports no format) and a dense matmul."""
    check = _CHECKS[name]

    def dequantize_cpu(*weights):
        _, k = check(*weights)
        return decode(k, *weights)

    def linear_cpu(x, *args):
        *weights, bias = args
        return _dense_linear(f"{name}_linear", x, dequantize_cpu(*weights), bias)

    torch.library.impl(f"torch_lowbit::{name}_dequantize", "CPU")(dequantize_cpu)
    torch.library.impl(f"torch_lowbit::{name}_linear", "CPU")(linear_cpu)


def _register_fakes(name: str, check) -> None:
    """Fake impls of <name>_linear(x, *weights, bias) and <name>_dequantize(*weights) -> fp32 [N, K],
    where check(*weights) validates the weights and returns (N, K)."""
    def linear_fake(x, *args):
        *weights, bias = args
        return _linear_out(f"{name}_linear", x, *check(*weights), bias)

    def dequantize_fake(*weights):
        return weights[0].new_empty(check(*weights), dtype=torch.float32)

    torch.library.register_fake(f"torch_lowbit::{name}_linear")(linear_fake)
    torch.library.register_fake(f"torch_lowbit::{name}_dequantize")(dequantize_fake)


def _register() -> None:
    cpu_extension()  # loads the schemas and CPU kernels

    for name, check in _CHECKS.items():
        _register_fakes(name, check)

    @torch.library.register_fake("torch_lowbit::lut_i8_linear")
    def _lut_i8_linear_fake(x, qweight, scales, mins, lut, code_bits, group_size, out_features, bias,
                            sub_groups=None, act_bits=0, act_clip=1.0, act_block=0):
        _check(1 <= code_bits <= 4 or code_bits == 8, f"lut_i8: code_bits must be 1..4 or 8, got {code_bits}")
        _check_act_args("lut_i8", act_bits, act_block)
        pairs = lut.dim() == 2  # a 2-D codebook: one code per pair of features, one table per coordinate
        _check(qweight.dtype == torch.uint8 and qweight.dim() == 3 and qweight.shape[2] == 64 * code_bits,
               f"lut_i8: qweight must be uint8 [N/16, K/{64 if pairs else 32}, {64 * code_bits}] for "
               f"{code_bits}-bit codes")
        tiles, k = qweight.shape[0], qweight.shape[1] * (64 if pairs else 32)
        _check(out_features <= tiles * 16 and out_features > (tiles - 1) * 16,
               f"lut_i8: out_features {out_features} does not fit {tiles} tiles of 16 rows")
        _check(group_size > 0 and group_size % 32 == 0 and k % group_size == 0,
               f"lut_i8: group size {group_size} must be a multiple of 32 dividing K={k}")
        _check(scales.dtype == torch.float16 and tuple(scales.shape) == (tiles, k // group_size, 16),
               f"lut_i8: scales must be fp16 [{tiles}, {k // group_size}, 16]")
        if mins is not None:
            _check(mins.dtype == torch.float16 and mins.shape == scales.shape, "lut_i8: mins must match scales")
        if pairs:
            _check(lut.dtype == torch.int8 and tuple(lut.shape) == (2, 2 ** code_bits) and code_bits <= 4
                   and sub_groups is None and group_size % 64 == 0 and act_bits == 0,
                   f"lut_i8: a pair codebook needs an int8 [2, {2 ** code_bits}] lut, codes of at most 4 bits, "
                   "no sub_groups, groups of 64k and act_bits 0")
        elif sub_groups is None:
            _check(lut.dtype == torch.int8 and lut.dim() == 1 and lut.numel() == 2 ** code_bits,
                   f"lut_i8: lut must be {2 ** code_bits} int8 values")
        else:
            _check(code_bits in (2, 3) and mins is None, "lut_i8: group codebooks need 2/3-bit codes and no mins")
            _check(sub_groups.dtype == torch.uint8 and tuple(sub_groups.shape) == (tiles, k // 32, 16),
                   f"lut_i8: sub_groups must be uint8 [{tiles}, {k // 32}, 16]")
            _check(lut.dtype == torch.int8 and 0 < lut.numel() <= 16 * 2 ** code_bits
                   and lut.numel() % 2 ** code_bits == 0,
                   f"lut_i8: lut must be 1..16 int8 codebooks of {2 ** code_bits} entries")
        return _linear_out("lut_i8_linear", x, out_features, k, bias)

    @torch.library.register_fake("torch_lowbit::q4x_linear")
    def _q4x_linear_fake(x, qweight, scales, lut, rows, chunk, group_size, out_features, bias, act_bits=0,
                         act_clip=1.0, act_block=0):
        _check(rows in (4, 8) and chunk in (4, 8), f"q4x: rows and chunk must be 4 or 8, got {rows}, {chunk}")
        _check_act_args("q4x", act_bits, act_block)
        _check(qweight.dtype == torch.uint8 and qweight.dim() == 3 and qweight.shape[2] == 16 * rows,
               f"q4x: qweight must be uint8 [N/{rows}, K/32, {16 * rows}]")
        groups, k = qweight.shape[0], qweight.shape[1] * 32
        _check((groups - 1) * rows < out_features <= groups * rows,
               f"q4x: out_features {out_features} does not fit {groups} groups of {rows} rows")
        _check(group_size > 0 and group_size % 32 == 0 and k % group_size == 0,
               f"q4x: group size {group_size} must be a multiple of 32 dividing K={k}")
        _check(scales.dtype == torch.float16 and tuple(scales.shape) == (groups, k // group_size, rows),
               f"q4x: scales must be fp16 [{groups}, {k // group_size}, {rows}]")
        _check(lut.dtype == torch.int8 and lut.numel() == 16, "q4x: lut must be 16 int8 values")
        return _linear_out("q4x_linear", x, out_features, k, bias)

    @torch.library.register_fake("torch_lowbit::gqa_attention")
    def _gqa_attention_fake(q, k, v, mask, scale):
        _check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "gqa_attention: q, k, v must be 4-D")
        _check(k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
               f"gqa_attention: query heads {q.shape[1]} are not a multiple of KV heads {k.shape[1]}")
        b, h, s, d = q.shape
        return q.new_empty((b, s, h, d))

    @torch.library.register_fake("torch_lowbit::kv_attention")
    def _kv_attention_fake(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, mask, scale, bits, k_recent=None,
                           v_recent=None, recent_end=None):
        _check(q.dim() == 4 and k_codes.dim() == 4, "kv_attention: q and k_codes must be 4-D")
        _check(k_codes.shape[1] > 0 and q.shape[1] % k_codes.shape[1] == 0,
               f"kv_attention: query heads {q.shape[1]} are not a multiple of KV heads {k_codes.shape[1]}")
        b, h, s, d = q.shape
        return q.new_empty((b, s, h, d))

    @torch.library.register_fake("torch_lowbit::codebook_linear")
    def _codebook_linear_fake(x, codes, code_bits, table, row_scales, bias):
        n, k = _codebook_check(codes, code_bits, table, row_scales, x.shape[-1])
        return _linear_out("codebook_linear", x, n, k, bias)

    @torch.library.register_fake("torch_lowbit::codebook_dequantize")
    def _codebook_dequantize_fake(codes, code_bits, table, row_scales, in_features):
        n, k = _codebook_check(codes, code_bits, table, row_scales, in_features)
        return codes.new_empty((n, k), dtype=torch.float32)

    @torch.library.register_fake("torch_lowbit::tcq_half_linear")
    def _tcq_half_linear_fake(x, codes_lo, table_lo, table_bits_lo, shift_bits_lo, codes_hi, table_hi,
                              table_bits_hi, shift_bits_hi, row_scales, bias):
        n, k_lo = _tcq_check(codes_lo, table_lo, table_bits_lo, shift_bits_lo, row_scales)
        n_hi, k_hi = _tcq_check(codes_hi, table_hi, table_bits_hi, shift_bits_hi, row_scales)
        _check(n_hi == n, f"tcq_half_linear: both halves' codes must have {n} rows")
        return _linear_out("tcq_half_linear", x, n, k_lo + k_hi, bias)

    @torch.library.impl("torch_lowbit::tcq_half_linear", "CPU")
    def _tcq_half_linear_cpu(x, codes_lo, table_lo, table_bits_lo, shift_bits_lo, codes_hi, table_hi,
                             table_bits_hi, shift_bits_hi, row_scales, bias):
        k_lo = codes_lo.shape[1] * 16
        y = torch.ops.torch_lowbit.tcq_linear(x[..., :k_lo], codes_lo, table_lo, table_bits_lo, shift_bits_lo,
                                              row_scales, None)
        return y + torch.ops.torch_lowbit.tcq_linear(x[..., k_lo:], codes_hi, table_hi, table_bits_hi,
                                                     shift_bits_hi, row_scales, bias)

    def _lut4_int_check(x, qweight, scales, mins, lut, group_size, bias, act_bits, act_clip, act_block):
        n, k = _lut4_check(qweight, scales, mins, lut.float(), group_size)
        _check(lut.dtype == torch.int8, "lut4_int_linear: lut must be the 16 int8 code values")
        _check(x.dtype in (torch.float32, torch.float16, torch.bfloat16) and x.dim() == 2 and x.shape[1] == k,
               f"lut4_int_linear: x must be float [M, {k}]")
        _check(act_bits in ACT_BITS and 0 < act_clip <= 1,
               "lut4_int_linear: act_bits must be 2, 3, 4 or 8 and act_clip in (0, 1]")
        _check_act_args("lut4_int_linear", act_bits, act_block)
        if bias is not None:
            _check(bias.dim() == 1 and bias.shape[0] == n, f"lut4_int_linear: bias must have {n} elements")
        return n, k

    @torch.library.register_fake("torch_lowbit::lut4_int_linear")
    def _lut4_int_linear_fake(x, qweight, scales, mins, lut, group_size, bias, act_bits, act_clip, act_block=0):
        n, _ = _lut4_int_check(x, qweight, scales, mins, lut, group_size, bias, act_bits, act_clip, act_block)
        return x.new_empty((x.shape[0], n), dtype=torch.float32)

    @torch.library.impl("torch_lowbit::lut4_int_linear", "CPU")
    def _lut4_int_linear_cpu(x, qweight, scales, mins, lut, group_size, bias, act_bits, act_clip, act_block=0):
        """The reference: x rounded per token or block (quantize_act_codes) times the dequantized weight in fp32."""
        _lut4_int_check(x, qweight, scales, mins, lut, group_size, bias, act_bits, act_clip, act_block)
        w = torch.ops.torch_lowbit.lut4_dequantize(qweight, scales, mins, lut.float(), group_size)
        x_hat = dequantize_act_codes(*quantize_act_codes(x, act_bits, act_clip, act_block))
        return torch.nn.functional.linear(x_hat, w, bias.float() if bias is not None else None)

    torch.library.impl("torch_lowbit::lut4_int_linear", "CUDA")(_triton_cuda("int_act", "lut4_int_linear"))

    for name in ("lut4_linear", "lut4_dequantize"):
        torch.library.impl(f"torch_lowbit::{name}", "CUDA")(_triton_cuda("lut4", name))

    # palette_packed (nuq/vq/tcq): triton_kernels/palette.py, same signatures as the ops
    for name in ("codebook_linear", "codebook_dequantize", "tcq_linear", "tcq_dequantize", "tcq_half_linear"):
        torch.library.impl(f"torch_lowbit::{name}", "CUDA")(_triton_cuda("palette", name))
    # decode attention over a quantized KV cache: triton_kernels/kv_attention.py
    torch.library.impl("torch_lowbit::kv_attention", "CUDA")(_triton_cuda("kv_attention", "kv_attention"))
    # lowbit_rowmajor / gcb_rowmajor: triton_kernels/lowbit.py
    for name in ("lowbit_linear", "lowbit_dequantize", "gcb_linear", "gcb_dequantize"):
        torch.library.impl(f"torch_lowbit::{name}", "CUDA")(_triton_cuda("lowbit", name))


def _triton_cuda(module, name):
    """The CUDA impl of op `name`: the same-named function of triton_kernels/<module>.py, imported on
    the first call (Triton loads only where a CUDA tensor meets the op) and kept: a decode step calls
    these hundreds of times, and the import machinery costs µs each time."""
    fn = []

    def impl(*args):
        if not fn:
            import importlib
            fn.append(getattr(importlib.import_module(f"..triton_kernels.{module}", __package__), name))
        return fn[0](*args)
    impl.__name__ = f"_{name}_cuda"
    return impl


_register()
