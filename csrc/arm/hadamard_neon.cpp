// NEON Hadamard kernels (4 floats per vector), the scheme of x86/hadamard_avx2.cpp: the two stages
// with stride h < 4 inside registers (h = 1: even / odd lanes of two vectors by uzp, sums and
// differences, zip back; h = 2: low and high halves), wider strides two stages per pass. Every output
// is the scalar path's sums in the scalar path's order (the +-1 mix products are exact), so the
// result equals fwht_scalar / block_mix_scalar bit for bit.
#if defined(__aarch64__)
#include <arm_neon.h>

#include "common/hadamard.h"

namespace torch_lowbit {
namespace {

constexpr int64_t kLanes = 4;
constexpr int64_t kL1Chunk = 2048;  // floats: 8 KiB

// Stages h = 1 and 2 of 8 floats at x.
inline void fwht8_in_registers(float* x) {
  const float32x4_t v0 = vld1q_f32(x), v1 = vld1q_f32(x + 4);
  const float32x4_t even = vuzp1q_f32(v0, v1), odd = vuzp2q_f32(v0, v1);  // x0 x2 x4 x6 | x1 x3 x5 x7
  const float32x4_t s = vaddq_f32(even, odd), d = vsubq_f32(even, odd);
  const float32x4_t w0 = vzip1q_f32(s, d), w1 = vzip2q_f32(s, d);  // stage 1 done, in order
  const float32x2_t lo0 = vget_low_f32(w0), hi0 = vget_high_f32(w0);
  const float32x2_t lo1 = vget_low_f32(w1), hi1 = vget_high_f32(w1);
  vst1q_f32(x, vcombine_f32(vadd_f32(lo0, hi0), vsub_f32(lo0, hi0)));
  vst1q_f32(x + 4, vcombine_f32(vadd_f32(lo1, hi1), vsub_f32(lo1, hi1)));
}

// Stages h_begin, 2 h_begin, ... < h_end (h_begin >= one vector) over x[0, len): two per pass,
// then a radix-2 pass if one is left.
void butterfly_passes(float* x, int64_t len, int64_t h_begin, int64_t h_end) {
  int64_t h = h_begin;
  for (; 4 * h <= h_end; h *= 4) {
    for (int64_t i = 0; i < len; i += 4 * h) {
      for (int64_t j = i; j < i + h; j += kLanes) {
        const float32x4_t v0 = vld1q_f32(x + j), v1 = vld1q_f32(x + j + h);
        const float32x4_t v2 = vld1q_f32(x + j + 2 * h), v3 = vld1q_f32(x + j + 3 * h);
        const float32x4_t s01 = vaddq_f32(v0, v1), d01 = vsubq_f32(v0, v1);
        const float32x4_t s23 = vaddq_f32(v2, v3), d23 = vsubq_f32(v2, v3);
        vst1q_f32(x + j, vaddq_f32(s01, s23));
        vst1q_f32(x + j + h, vaddq_f32(d01, d23));
        vst1q_f32(x + j + 2 * h, vsubq_f32(s01, s23));
        vst1q_f32(x + j + 3 * h, vsubq_f32(d01, d23));
      }
    }
  }
  if (2 * h == h_end) {
    for (int64_t i = 0; i < len; i += 2 * h) {
      for (int64_t j = i; j < i + h; j += kLanes) {
        const float32x4_t lo = vld1q_f32(x + j), hi = vld1q_f32(x + j + h);
        vst1q_f32(x + j, vaddq_f32(lo, hi));
        vst1q_f32(x + j + h, vsubq_f32(lo, hi));
      }
    }
  }
}

void fwht_block(float* x, int64_t len) {
  // strides below kL1Chunk run chunk by chunk while the chunk sits in L1, as on x86
  const int64_t chunk = len < kL1Chunk ? len : kL1Chunk;
  for (int64_t c0 = 0; c0 < len; c0 += chunk) {
    for (int64_t j = c0; j < c0 + chunk; j += 2 * kLanes) fwht8_in_registers(x + j);
    butterfly_passes(x + c0, chunk, kLanes, chunk);
  }
  butterfly_passes(x, len, chunk, len);
}

// Output blocks c..c+3, columns j..j+4*V: four rows of the mix share every input load.
template <int V>
inline void mix_tile(const float* mix, int64_t k, const float* in, float* out, int64_t len, int64_t c, int64_t j) {
  float32x4_t acc[4][V];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vdupq_n_f32(0.f);
  for (int64_t a = 0; a < k; ++a) {
    float32x4_t src[V];
    for (int v = 0; v < V; ++v) src[v] = vld1q_f32(in + a * len + j + v * kLanes);
    for (int r = 0; r < 4; ++r) {
      const float m = mix[(c + r) * k + a];
      for (int v = 0; v < V; ++v) acc[r][v] = vfmaq_n_f32(acc[r][v], src[v], m);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < V; ++v) vst1q_f32(out + (c + r) * len + j + v * kLanes, acc[r][v]);
}

}  // namespace

void fwht_neon(float* data, int64_t blocks, int64_t len) {
  if (len < 2 * kLanes) return fwht_scalar(data, blocks, len);
  for (int64_t b = 0; b < blocks; ++b) fwht_block(data + b * len, len);
}

void block_mix_neon(const float* mix, int64_t k, const float* in, float* out, int64_t len) {
  if (len < kLanes || k % 4 != 0) return block_mix_scalar(mix, k, in, out, len);
  for (int64_t c = 0; c < k; c += 4) {
    int64_t j = 0;
    for (; j + 4 * kLanes <= len; j += 4 * kLanes) mix_tile<4>(mix, k, in, out, len, c, j);
    for (; j < len; j += kLanes) mix_tile<1>(mix, k, in, out, len, c, j);
  }
}

}  // namespace torch_lowbit
#endif  // __aarch64__
