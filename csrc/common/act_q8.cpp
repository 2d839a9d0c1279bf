#include "common/act_q8.h"

#include <algorithm>
#include <cmath>

#include "common/dispatch.h"
#include "common/parallel.h"

namespace torch_lowbit {

namespace {

void quantize_act_blocks_scalar(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, int32_t* sum) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = x + b * 32;  // blocks of a row are contiguous, rows are contiguous
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float db = amax / 127.f;
    const float inv = db != 0.f ? 1.f / db : 0.f;
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));  // half-even
      q[b * 32 + j] = static_cast<int8_t>(v);
      s += v;
    }
    d[b] = db;
    sum[b] = s;
  }
}

void round_codes_scalar(const float* x, int64_t K, float d, int qmin, int qmax, int8_t* q) {
  for (int64_t k = 0; k < K; ++k)  // x / d rounded half to even (the default mode), as torch.round
    q[k] = static_cast<int8_t>(std::min<float>(std::max<float>(std::nearbyint(x[k] / d), qmin), qmax));
}

RoundCodesFn active_round_codes() {
#if defined(TORCH_LOWBIT_X86)
  if (kernel_isa(active_cpu_path()) != CpuPath::Scalar) return quantize_token_avx2;
#elif defined(__aarch64__)
  if (active_cpu_path() != CpuPath::Scalar) return quantize_token_neon;
#endif
  return round_codes_scalar;
}

}  // namespace

void quantize_acts_q8(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* sum) {
  auto blocks_fn = quantize_act_blocks_scalar;
#if defined(TORCH_LOWBIT_X86)
  const CpuPath path = kernel_isa(active_cpu_path());
  if (path == CpuPath::Avx512) blocks_fn = quantize_act_blocks_avx512;
  if (path == CpuPath::Avx2) blocks_fn = quantize_act_blocks_avx2;
#endif
#if defined(__aarch64__)
  if (active_cpu_path() != CpuPath::Scalar) blocks_fn = quantize_act_blocks_neon;
#endif
  const int64_t blocks = M * (K / 32);
  parallel_for(0, blocks, 256, [&](int64_t b0, int64_t b1) { blocks_fn(x, b0, b1, q, d, sum); });
}

void quantize_acts_per_token(const float* x, int64_t M, int64_t K, int bits, double clip, int8_t* q, float* d,
                             int32_t* sum) {
  const int qmax = (1 << (bits - 1)) - 1;
  const int qmin = bits == 8 ? -qmax : -qmax - 1;  // -128 never: the kernels negate codes with vpsignb
  const float ratio = static_cast<float>(clip / qmax);  // as torch: fp32 amax times the scalar cast to fp32
  const int64_t kb = K / 32;
  const RoundCodesFn round_codes = active_round_codes();
  parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
      float dt = amax * ratio;
      if (!(dt > 0.f)) dt = 1.f;
      int8_t* qr = q + m * K;
      round_codes(xr, K, dt, qmin, qmax, qr);
      for (int64_t b = 0; b < kb; ++b) {
        int32_t s = 0;
        for (int64_t i = 0; i < 32; ++i) s += qr[b * 32 + i];
        d[m * kb + b] = dt;
        sum[m * kb + b] = s;
      }
    }
  });
}

void quantize_acts_sub_blocks(const float* x, int64_t M, int64_t K, int sub, int bits, double clip, int8_t* q,
                              float* d, int32_t* sum) {
  const float ratio = static_cast<float>(clip / ((1 << (bits - 1)) - 1));
  const RoundCodesFn round_codes = active_round_codes();
#if defined(TORCH_LOWBIT_X86)
  if (kernel_isa(active_cpu_path()) != CpuPath::Scalar) {
    parallel_for(0, M * (K / 32), 64, [&](int64_t b0, int64_t b1) {
      quantize_sub_blocks_avx2(x, b0, b1, sub, bits, ratio, q, d, sum);
    });
    return;
  }
#endif
  parallel_for(0, M * (K / 32), 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) quantize_sub_block32(x + b * 32, sub, bits, ratio, round_codes, q + b * 32, d + b, sum + b);
  });
}

void group_dsums(const Q8Acts& a, int64_t group, float* out) {
  const int64_t kb = a.K / 32, groups = a.K / group, per_group = group / 32;
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
        const float term = a.d[m * kb + b] * static_cast<float>(a.sum[m * kb + b]);
        s += term;
      }
      out[m * groups + g] = s;
    }
}

}  // namespace torch_lowbit
