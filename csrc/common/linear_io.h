// What every CPU linear op does around its kernel: check activations, group size, bias and
// devices; hand the kernel fp32 activations [M, K]; add the bias and return x's dtype and shape.
#pragma once
#include <ATen/ATen.h>

#include <initializer_list>

namespace torch_lowbit {

// The weight side: group size, bias, and the weight tensors on the CPU.
inline void check_linear_params(const char* op, int64_t K, int64_t N, int64_t group,
                                const c10::optional<at::Tensor>& bias, std::initializer_list<const at::Tensor*> cpu) {
  if (group != 0)  // 0: the format has no groups along K
    TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0, op, ": group size ", group,
                " must be a multiple of 32 dividing K=", K);
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_floating_point(), op,
                ": bias must be a float vector of length N=", N);
  for (const at::Tensor* t : cpu) TORCH_CHECK(t->device().is_cpu(), op, " (CPU kernel): all tensors must be on the CPU");
}

inline void check_linear_io(const char* op, const at::Tensor& x, int64_t K, int64_t N, int64_t group,
                            const c10::optional<at::Tensor>& bias, std::initializer_list<const at::Tensor*> cpu) {
  TORCH_CHECK(x.is_floating_point() && x.scalar_type() != at::kDouble && x.dim() >= 1, op,
              ": x must be a float32, bfloat16 or float16 tensor, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) == K, op, ": x has ", x.size(-1), " features but the weight has K=", K);
  TORCH_CHECK(x.device().is_cpu(), op, " (CPU kernel): all tensors must be on the CPU");
  check_linear_params(op, K, N, group, bias, cpu);
}

inline void check_group_params(const char* op, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                               at::IntArrayRef expected) {
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.sizes() == expected, op, ": scales must be fp16 ",
              expected, ", got ", scales.scalar_type(), " ", scales.sizes());
  if (mins.has_value())
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->sizes() == scales.sizes(), op,
                ": mins must be fp16 with the shape of scales");
}

// x [..., K] as contiguous fp32 [M, K].
inline at::Tensor activations_fp32(const at::Tensor& x, int64_t K) {
  return x.reshape({-1, K}).to(at::kFloat).contiguous();
}

// out [M, N] fp32 -> + bias (unless the kernel fused it), x's dtype, x's leading dims.
inline at::Tensor finish_linear(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                               bool bias_fused = false) {
  if (bias.has_value() && !bias_fused) out.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out.size(1);
  return out.to(x.scalar_type()).view(shape);
}

}  // namespace torch_lowbit
