"""The op table: every torch_lowbit op's schema, here and nowhere else.

Defined from Python (one torch.library.Library of kind DEF, kept alive here for the process) so the
ops exist whether or not the C++ extension is built: the extension (csrc/) only binds CPU kernels to
these names, and the dispatcher checks each kernel's signature against its schema whichever of the
two registers first. Implementations are registered per op family in torch_lowbit/ops/<family>.py
(fakes, Triton CUDA impls, the Python CPU impls of the ops with no C++ kernel, and the pure-torch CPU
references when the extension is absent); hadamard_transform's in torch_lowbit/rotations/ops.py.
"""
from __future__ import annotations

import torch

NAMESPACE = "torch_lowbit"

SCHEMAS: dict[str, str] = {
    "lut4_linear": "lut4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, int group_size, "
                   "Tensor? bias) -> Tensor",
    "lut_i8_linear": "lut_i8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, int code_bits, "
                     "int group_size, int out_features, Tensor? bias, Tensor? sub_groups=None, int act_bits=0, "
                     "float act_clip=1.0, int act_block=0, Tensor? sub_scales=None, Tensor? sub_mins=None) -> Tensor",
    # the interleaved ARM layouts q4_{R}x{S} (csrc/common/q4x.h, layouts/q4x.py)
    "q4x_linear": "q4x_linear(Tensor x, Tensor qweight, Tensor scales, Tensor lut, int rows, int chunk, "
                  "int group_size, int out_features, Tensor? bias, int act_bits=0, float act_clip=1.0, "
                  "int act_block=0) -> Tensor",
    "lut4_dequantize": "lut4_dequantize(Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, int group_size) "
                       "-> Tensor",
    # integer activations (x rounded per token, act_block 0, or per 32 features, act_block 32 / 16 / 8:
    # core.activations.quantize_act_codes) x lut4_rowmajor weights (int8 table): fp32 [M, N]; CUDA: Triton's
    # integer tl.dot (triton_kernels/int_act.py), CPU: the reference in Python
    "lut4_int_linear": "lut4_int_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, "
                       "int group_size, Tensor? bias, int act_bits, float act_clip, int act_block=0) -> Tensor",
    "codebook_linear": "codebook_linear(Tensor x, Tensor codes, int code_bits, Tensor table, Tensor row_scales, "
                       "Tensor? bias) -> Tensor",
    "codebook_dequantize": "codebook_dequantize(Tensor codes, int code_bits, Tensor table, Tensor row_scales, "
                           "int in_features) -> Tensor",
    "tcq_linear": "tcq_linear(Tensor x, Tensor codes, Tensor table, int table_bits, int shift_bits, "
                  "Tensor row_scales, Tensor? bias) -> Tensor",
    "tcq_dequantize": "tcq_dequantize(Tensor codes, Tensor table, int table_bits, int shift_bits, "
                      "Tensor row_scales) -> Tensor",
    # half-TCQ as one op, so a CUDA model runs both halves of K in one Triton launch
    "tcq_half_linear": "tcq_half_linear(Tensor x, Tensor codes_lo, Tensor table_lo, int table_bits_lo, "
                       "int shift_bits_lo, Tensor codes_hi, Tensor table_hi, int table_bits_hi, int shift_bits_hi, "
                       "Tensor row_scales, Tensor? bias) -> Tensor",
    # the off-CPU layouts of the sub-4-bit group formats (layouts/stream_rowmajor.py, layouts/gcb.py gcb_rowmajor)
    "lowbit_linear": "lowbit_linear(Tensor x, Tensor codes, int code_bits, Tensor scales, Tensor? mins, Tensor lut, "
                     "int group_size, Tensor? bias) -> Tensor",
    "lowbit_dequantize": "lowbit_dequantize(Tensor codes, int code_bits, Tensor scales, Tensor? mins, Tensor lut, "
                         "int group_size) -> Tensor",
    "gcb_linear": "gcb_linear(Tensor x, Tensor codes, int code_bits, Tensor sub_groups, Tensor super_scales, "
                  "Tensor codebooks, Tensor? bias) -> Tensor",
    "gcb_dequantize": "gcb_dequantize(Tensor codes, int code_bits, Tensor sub_groups, Tensor super_scales, "
                      "Tensor codebooks) -> Tensor",
    # general VQ (layouts/gvq.py): codes as LSB-first bit fields in chunks of fields (chunk-major),
    # codebooks fp16 planes [regions, stages, vec, 2^code_bits], one region per tile_rows x tile_cols (0: all)
    "gvq_linear": "gvq_linear(Tensor x, Tensor codes, int code_bits, Tensor codebooks, int tile_rows, "
                  "int tile_cols, Tensor row_scales, Tensor? bias) -> Tensor",
    "gvq_dequantize": "gvq_dequantize(Tensor codes, int code_bits, Tensor codebooks, int tile_rows, "
                      "int tile_cols, Tensor row_scales, int in_features) -> Tensor",
    # the off-CPU layout of the K-quants (layouts/kquant_stream.py): w = (d sub_scale) code - dmin sub_min,
    # or (d sub_scale) (code - code_offset); int8 sub_scales, uint8 sub_mins, fp16 d / dmin per 256
    "kquant_linear": "kquant_linear(Tensor x, Tensor codes, int code_bits, Tensor sub_scales, Tensor? sub_mins, "
                     "Tensor d, Tensor? dmin, int sub_block, int code_offset, Tensor? bias) -> Tensor",
    "kquant_dequantize": "kquant_dequantize(Tensor codes, int code_bits, Tensor sub_scales, Tensor? sub_mins, "
                         "Tensor d, Tensor? dmin, int sub_block, int code_offset) -> Tensor",
    # the randomized Hadamard transform of the rotated formats (rotations/hadamard.py); its base matrices
    # reach the C++ kernel through _C.register_hadamard_base (rotations/ops.py)
    "hadamard_transform": "hadamard_transform(Tensor x, Tensor? signs, bool inverse) -> Tensor",
    # the tail-biting Viterbi of TCQ quantization (formats/tcq.py)
    "tcq_viterbi": "tcq_viterbi(Tensor sequences, Tensor state_values, int shift_bits) -> (Tensor states, "
                   "Tensor errors)",
    # grouped-query attention of compiled generation (torch_lowbit/generation.py), [B, S, H, D] out
    "gqa_attention": "gqa_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor",
    # the same over a group-wise quantized KV cache (torch_lowbit/kv_cache.py), [B, S, H, D] out
    "kv_attention": "kv_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_min, Tensor v_codes, "
                    "Tensor v_scale, Tensor v_min, Tensor? mask, float scale, int bits, Tensor? k_recent=None, "
                    "Tensor? v_recent=None, Tensor? recent_end=None) -> Tensor",
    # the same over a vector-quantized (CQ) KV cache (formats/kv_vq.py): one byte per channel group,
    # fp16 codebook planes [Hkv, groups, vec, entries]
    "kv_vq_attention": "kv_vq_attention(Tensor q, Tensor k_codes, Tensor k_planes, Tensor v_codes, Tensor v_planes, "
                       "Tensor? mask, float scale) -> Tensor",
}

# The ops the C++ extension binds a CPU kernel to (csrc/ops.cpp, hadamard.cpp, tcq_viterbi.cpp): where
# it is absent, each gets the pure-torch reference of its family module instead.
CPU_KERNEL_OPS = ("lut4_linear", "lut4_dequantize", "lut_i8_linear", "q4x_linear", "codebook_linear",
                  "codebook_dequantize", "tcq_linear", "tcq_dequantize", "gvq_linear", "gvq_dequantize",
                  "gqa_attention", "kv_attention", "kv_vq_attention",
                  "hadamard_transform", "tcq_viterbi")

_LIBRARY = torch.library.Library(NAMESPACE, "DEF")  # the definitions live as long as this object
for _name, _schema in SCHEMAS.items():
    assert _schema.startswith(_name + "("), _name  # the key is the op's name
    _LIBRARY.define(_schema)
