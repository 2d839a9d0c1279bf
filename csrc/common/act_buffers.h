// The int8 activations of one call of an int8-weight op (lut_i8_linear, q4x_linear): per-32 blocks
// (act_bits 0), QuaRot's per-token codes (act_bits 8, 4, 3, 2), or those codes with one scale per
// block of 32 features (act_block 32: MXINT-style block-scaled activations) or per 16 / 8 (two-level
// scales, quantize_sub_block32; act_bits <= 4), with the per-group sums
// the kernels read (group_dsum for formats with mins; group_qsum for per-token activations).
#pragma once
#include <ATen/ATen.h>

#include "common/act_q8.h"

namespace torch_lowbit {

// The per-token kernels' int32 group sums hold groups of at most this many features.
constexpr int64_t kI8MaxIntGroup = 65536;

struct ActBuffers {
  at::Tensor storage;  // owns every buffer `acts` points into
  Q8Acts acts;
};

// The block act_block may name besides 0 (one scale per token) and the sub-blocks 16 / 8: the kernels'
// activation block.
constexpr int64_t kActBlock = 32;

// x2: contiguous fp32 [M, K]. per_token_sums: let per-token activations use int32 group sums (false
// for kernels whose block factor varies, group codebooks). half_sums: also Q8Acts::half_sum (K-quants'
// sub-blocks of 16). Checks act_bits / act_clip / act_block / the group bound, naming the op.
// into: int8 storage to write into instead of a new allocation (at least as large as this call needs),
// so that a caller can keep the buffers' addresses from call to call.
ActBuffers quantize_activations(const char* op, const at::Tensor& x2, int64_t group, int64_t act_bits,
                                double act_clip, int64_t act_block, bool with_mins, bool per_token_sums,
                                bool half_sums = false, const at::Tensor& into = at::Tensor());

}  // namespace torch_lowbit
