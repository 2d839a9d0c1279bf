// Portable scalar lut4 kernels: the path every optimized ISA path is tested against.
#include "common/lut4.h"

#include <algorithm>

namespace torch_lowbit {

namespace {
// Decodes the 32 weights of row n starting at column k (a multiple of 32).
inline void decode32(const Lut4Weights& w, int64_t n, int64_t k, float* out) {
  uint8_t codes[32];
  lut4_unpack32(w.qweight + n * (w.K / 2) + k / 2, codes);
  const int64_t g = n * (w.K / w.group) + k / w.group;
  const float s = static_cast<float>(w.scales[g]);
  const float m = w.mins ? static_cast<float>(w.mins[g]) : 0.f;
  for (int j = 0; j < 32; ++j) out[j] = w.lut[codes[j]] * s + m;
}
}  // namespace

void lut4_gemv_scalar(const Lut4Weights& w, const float* x, int64_t M, int64_t n0, int64_t n1,
                      float* out, int64_t ldo) {
  constexpr int64_t kTokens = 8;
  float wbuf[32];
  for (int64_t m0 = 0; m0 < M; m0 += kTokens) {
    const int64_t mt = std::min(kTokens, M - m0);
    for (int64_t n = n0; n < n1; ++n) {
      float acc[kTokens] = {0};
      for (int64_t k = 0; k < w.K; k += 32) {
        decode32(w, n, k, wbuf);
        for (int64_t t = 0; t < mt; ++t) {
          const float* xr = x + (m0 + t) * w.K + k;
          float s = 0.f;
          for (int j = 0; j < 32; ++j) s += wbuf[j] * xr[j];
          acc[t] += s;
        }
      }
      for (int64_t t = 0; t < mt; ++t) out[(m0 + t) * ldo + n] = acc[t];
    }
  }
}

void lut4_dequant_scalar(const Lut4Weights& w, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t k = 0; k < w.K; k += 32) decode32(w, n, k, dst + (n - n0) * w.K + k);
}

}  // namespace torch_lowbit
