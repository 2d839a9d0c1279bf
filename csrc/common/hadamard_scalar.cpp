// Portable Hadamard kernels: the path the SIMD paths are tested against, and their fallback for
// blocks shorter than one vector.
#include "common/hadamard.h"

namespace torch_lowbit {

void fwht_scalar(float* data, int64_t blocks, int64_t len) {
  for (int64_t b = 0; b < blocks; ++b) {
    float* x = data + b * len;
    for (int64_t h = 1; h < len; h *= 2) {
      for (int64_t i = 0; i < len; i += 2 * h) {
        for (int64_t j = i; j < i + h; ++j) {
          const float lo = x[j], hi = x[j + h];
          x[j] = lo + hi;
          x[j + h] = lo - hi;
        }
      }
    }
  }
}

void block_mix_scalar(const float* mix, int64_t k, const float* in, float* out, int64_t len) {
  for (int64_t c = 0; c < k; ++c) {
    float* dst = out + c * len;
    for (int64_t j = 0; j < len; ++j) dst[j] = 0.f;
    for (int64_t a = 0; a < k; ++a) {
      const float m = mix[c * k + a];
      const float* src = in + a * len;
      for (int64_t j = 0; j < len; ++j) dst[j] += m * src[j];
    }
  }
}

}  // namespace torch_lowbit
