// A lut_i8 weight checked once and described for the kernels (LutI8Weights over the tensors it keeps
// alive): lut_i8_linear prepares its weight on every call, the native decoder (csrc/native_decoder.cpp)
// once per model.
#pragma once
#include <ATen/ATen.h>

#include "common/act_buffers.h"
#include "common/lut_i8.h"

namespace torch_lowbit {

struct LutI8Prepared {
  at::Tensor qweight, scales, mins, lut, bias, sub_groups;  // contiguous owners of what w points into
  LutI8Weights w;
  int64_t tiles = 0;
};

// Checks the weight arguments of lut_i8_linear (naming `op` in errors) and describes them.
LutI8Prepared prepare_lut_i8(const char* op, const at::Tensor& qweight, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t code_bits,
                             int64_t group, int64_t out_features, const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& sub_groups);

// The tile kernel of the active ISA path for this weight.
LutI8Fn lut_i8_kernel(const LutI8Weights& w);

// x2 contiguous fp32 [M, K] as the int8 activations the kernels read for this weight (per-32 blocks).
inline ActBuffers lut_i8_activations(const char* op, const LutI8Prepared& p, const at::Tensor& x2) {
  return quantize_activations(op, x2, p.w.group, 0, 1.0, 0, p.w.mins != nullptr, p.w.sub_groups == nullptr);
}

}  // namespace torch_lowbit
