// torch_lowbit::q4x_linear on CPU: the interleaved q4_{R}x{S} layouts (common/q4x.h), int8 activations
// (per-32 blocks, or per token to act_bits), threaded over row groups. aarch64: sdot for S = 4 (dotprod),
// smmla for S = 8 (i8mm); elsewhere, and for the layout a CPU has no instruction for, the scalar kernel.
#include <ATen/ATen.h>

#include "common/act_buffers.h"
#include "common/dispatch.h"
#include "common/linear_io.h"
#include "common/parallel.h"
#include "common/q4x.h"

namespace torch_lowbit {
namespace {

Q4xFn kernel_for(CpuPath p, int chunk) {
#if defined(__aarch64__)
  if (chunk == 8 && p == CpuPath::I8mm) return q4x_i8mm;
  if (chunk == 4 && (p == CpuPath::Dotprod || p == CpuPath::I8mm)) return q4x_dotprod;
#endif
  (void)p;
  (void)chunk;
  return q4x_scalar;
}

}  // namespace

at::Tensor q4x_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const at::Tensor& lut, int64_t rows, int64_t chunk, int64_t group, int64_t out_features,
                          const c10::optional<at::Tensor>& bias, int64_t act_bits, double act_clip, int64_t act_block) {
  TORCH_CHECK((rows == 4 || rows == 8) && (chunk == 4 || chunk == 8), "q4x_linear: rows and chunk must be 4 or 8, got ",
              rows, " and ", chunk);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 3 && qweight.size(2) == 16 * rows,
              "q4x_linear: qweight must be uint8 [N/", rows, ", K/32, ", 16 * rows, "]");
  const int64_t row_groups = qweight.size(0), K = qweight.size(1) * 32, N = out_features;
  TORCH_CHECK(N > (row_groups - 1) * rows && N <= row_groups * rows, "q4x_linear: out_features ", N,
              " does not match ", row_groups, " groups of ", rows, " rows");
  check_linear_io("q4x_linear", x, K, N, group, bias, {&qweight, &scales, &lut});
  check_group_params("q4x_linear", scales, c10::nullopt, {row_groups, K / group, rows});
  TORCH_CHECK(lut.scalar_type() == at::kChar && lut.numel() == 16, "q4x_linear: lut must be the 16 int8 code values");

  const at::Tensor x2 = activations_fp32(x, K);
  const int64_t M = x2.size(0);
  const at::Tensor qw = qweight.contiguous(), sc = scales.contiguous(), lt = lut.contiguous();
  const at::Tensor b32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  Q4xWeights w{qw.data_ptr<uint8_t>(), sc.data_ptr<c10::Half>(), {}, true, static_cast<int>(rows),
               static_cast<int>(chunk), N, K, group, bias.has_value() ? b32.data_ptr<float>() : nullptr};
  const int8_t* table = lt.data_ptr<int8_t>();
  for (int i = 0; i < 16; ++i) {
    w.table[i] = table[i];
    w.toggled &= table[i] == i - 8;  // the layout toggles the nibbles' top bit exactly for these tables
  }
  const ActBuffers acts = quantize_activations("q4x_linear", x2, group, act_bits, act_clip, act_block, false, true);
  at::Tensor out = at::empty({M, N}, x2.options());
  if (M > 0) {
    const Q4xFn kern = kernel_for(active_cpu_path(), static_cast<int>(chunk));
    float* op = out.data_ptr<float>();
    parallel_for(0, row_groups, 1, [&](int64_t g0, int64_t g1) { kern(w, acts.acts, g0, g1, op, N); });
  }
  return finish_linear(out, x, bias, /*bias_fused=*/true);
}

}  // namespace torch_lowbit
