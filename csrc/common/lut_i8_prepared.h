// A lut_i8 weight checked once and described for the kernels (LutI8Weights over the tensors it keeps
// alive): lut_i8_linear prepares its weight on every call, the native decoder (csrc/native_decoder.cpp)
// once per model.
#pragma once
#include <ATen/ATen.h>

#include "common/act_buffers.h"
#include "common/lut_i8.h"

namespace torch_lowbit {

struct LutI8Prepared {
  at::Tensor qweight, scales, mins, lut, bias, sub_groups, sub_scales, sub_mins;  // owners of what w points into
  LutI8Weights w;
  int64_t tiles = 0;
};

// Checks the weight arguments of lut_i8_linear (naming `op` in errors) and describes them.
LutI8Prepared prepare_lut_i8(const char* op, const at::Tensor& qweight, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t code_bits,
                             int64_t group, int64_t out_features, const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& sub_groups,
                             const c10::optional<at::Tensor>& sub_scales = c10::nullopt,
                             const c10::optional<at::Tensor>& sub_mins = c10::nullopt);

// The tile kernel of the active ISA path for this weight.
LutI8Fn lut_i8_kernel(const LutI8Weights& w);

// x2 contiguous fp32 [M, K] as the int8 activations the kernels read for this weight (per-32 blocks, or
// the act_* rounding of lut_i8_linear's arguments).
inline ActBuffers lut_i8_activations(const char* op, const LutI8Prepared& p, const at::Tensor& x2, int64_t act_bits = 0,
                                     double act_clip = 1.0, int64_t act_block = 0, const at::Tensor& into = at::Tensor()) {
  const LutI8Weights& w = p.w;
  const bool group_mins = w.mins != nullptr && w.sub_scales == nullptr;  // K-quants' mins read block sums
  return quantize_activations(op, x2, w.group, act_bits, act_clip, act_block, group_mins, w.sub_groups == nullptr,
                              /*half_sums=*/w.sub_scales != nullptr && w.sub_block == 16, into);
}

}  // namespace torch_lowbit
