// torch_lowbit::lut4_linear on CPU: validation, activation conversion, path choice and threading.
//
// Activations: converted once per call to an fp32 buffer (the weight is decoded exactly, in fp32,
// so the result equals x @ dequantize().T up to fp32 summation order). Small M uses the fused
// decode-and-dot GEMV kernels; large M decodes tiles of rows into fp32 and hands them to ATen's
// GEMM, where the weight decode is amortized over many tokens.
#include <ATen/ATen.h>

#include <algorithm>

#include "common/dispatch.h"
#include "common/linear_io.h"
#include "common/lut4.h"
#include "common/parallel.h"

namespace torch_lowbit {
namespace {

constexpr int64_t kFusedMaxTokens = 16;  // above this, decode tiles + GEMM wins
constexpr int64_t kGemmTileRows = 256;

struct Lut4Kernels {
  Lut4GemvFn gemv;
  Lut4DequantFn dequant;
};

Lut4Kernels kernels_for(CpuPath p) {
  switch (kernel_isa(p)) {
#if defined(TORCH_LOWBIT_X86)
    case CpuPath::Avx512: return {lut4_gemv_avx512, lut4_dequant_avx512};
    case CpuPath::Avx2: return {lut4_gemv_avx2, lut4_dequant_avx2};
#endif
    default: return {lut4_gemv_scalar, lut4_dequant_scalar};
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t group,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2,
              "lut4_linear: qweight must be a 2-D uint8 tensor [N, K/2]");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  check_linear_io("lut4_linear", x, K, N, group, bias, {&qweight, &scales, &lut});
  check_group_params("lut4_linear", scales, mins, {N, K / group});
  TORCH_CHECK(lut.scalar_type() == at::kFloat && lut.numel() == 16, "lut4_linear: lut must be 16 fp32 values");
}

}  // namespace

at::Tensor lut4_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t group,
                           const c10::optional<at::Tensor>& bias) {
  check_inputs(x, qweight, scales, mins, lut, group, bias);
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  const at::Tensor x2 = activations_fp32(x, K);
  const int64_t M = x2.size(0);
  const at::Tensor qw = qweight.contiguous(), sc = scales.contiguous(), lt = lut.contiguous();
  const at::Tensor mn = mins.has_value() ? mins->contiguous() : at::Tensor();
  const Lut4Weights w{qw.data_ptr<uint8_t>(), sc.data_ptr<c10::Half>(),
                      mins.has_value() ? mn.data_ptr<c10::Half>() : nullptr, lt.data_ptr<float>(), N, K, group};
  const Lut4Kernels kern = kernels_for(active_cpu_path());

  at::Tensor out = at::empty({M, N}, x2.options());
  if (M > 0 && M <= kFusedMaxTokens) {
    const float* xp = x2.data_ptr<float>();
    float* op = out.data_ptr<float>();
    // Grain: enough rows per task that each thread streams a few hundred KiB of weights.
    const int64_t grain = std::max<int64_t>(16, (1 << 16) / std::max<int64_t>(K, 1));
    parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { kern.gemv(w, xp, M, n0, n1, op, N); });
  } else if (M > 0) {
    const int64_t rows = std::min(kGemmTileRows, N);
    at::Tensor tile = at::empty({rows, K}, x2.options());
    for (int64_t t0 = 0; t0 < N; t0 += rows) {
      const int64_t nt = std::min(rows, N - t0);
      float* tp = tile.data_ptr<float>();
      parallel_for(t0, t0 + nt, 8, [&](int64_t n0, int64_t n1) {
        kern.dequant(w, n0, n1, tp + (n0 - t0) * K);
      });
      out.narrow(1, t0, nt).copy_(at::mm(x2, tile.narrow(0, 0, nt).t()));
    }
  }
  return finish_linear(out, x, bias);
}

at::Tensor lut4_dequantize_cpu(const at::Tensor& qweight, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t group) {
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  check_inputs(at::empty({0, K}), qweight, scales, mins, lut, group, c10::nullopt);
  const at::Tensor qw = qweight.contiguous(), sc = scales.contiguous(), lt = lut.contiguous();
  const at::Tensor mn = mins.has_value() ? mins->contiguous() : at::Tensor();
  const Lut4Weights w{qw.data_ptr<uint8_t>(), sc.data_ptr<c10::Half>(),
                      mins.has_value() ? mn.data_ptr<c10::Half>() : nullptr, lt.data_ptr<float>(), N, K, group};
  const Lut4Kernels kern = kernels_for(active_cpu_path());
  at::Tensor out = at::empty({N, K}, at::kFloat);
  float* op = out.data_ptr<float>();
  parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) { kern.dequant(w, n0, n1, op + n0 * K); });
  return out;
}

}  // namespace torch_lowbit
