// The body of one attention row (common/decoder_rows.h), included by one file per ISA path, each
// compiling it for its own target (the loops vectorize to that width).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace torch_lowbit {
namespace {

// e^x for x <= 0 (scores minus their maximum), relative error < 3e-7, written so the loop over keys
// vectorizes (std::exp is a scalar call): x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' expf
// polynomial, 2^n through the exponent bits. Below -87 the result is denormal-free 0-ish (~1e-38).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low mantissa bits
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline void attend_row_impl(const float* q, const float* k, const float* v, int64_t stride, int64_t L, int64_t D,
                            float scale, const float* mask, int64_t mask_stride, float* p, float* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float mx = kNegInf;
  for (int64_t j = 0; j < L; ++j) {
    const float* krow = k + j * stride;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < D; ++i) dot += q[i] * krow[i];
    float sc = dot * scale;
    if (mask) sc += mask[j * mask_stride];
    p[j] = sc;
    mx = std::max(mx, sc);
  }
  for (int64_t i = 0; i < D; ++i) out[i] = 0.f;
  if (mx == kNegInf) {  // every key masked: softmax of all -inf is NaN
    for (int64_t i = 0; i < D; ++i) out[i] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < L; ++j) {
    const float e = p[j] == kNegInf ? 0.f : exp_nonpositive(p[j] - mx);
    p[j] = e;
    total += e;
  }
  for (int64_t j = 0; j < L; ++j) {
    const float e = p[j];
    if (e == 0.f) continue;
    const float* vrow = v + j * stride;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) out[i] += e * vrow[i];
  }
  const float inv = 1.f / total;
  for (int64_t i = 0; i < D; ++i) out[i] *= inv;
}

// G query rows q (G x D, contiguous) of the heads that share one KV head (grouped-query attention), no
// mask: each key and value row is read once for all of them. p: scratch of G x L floats; out: G x D.
inline void attend_group_impl(const float* q, int64_t G, const float* k, const float* v, int64_t stride, int64_t L,
                              int64_t D, float scale, float* p, float* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int64_t kMaxGroup = 16;
  if (G > kMaxGroup) {
    for (int64_t g = 0; g < G; ++g) attend_row_impl(q + g * D, k, v, stride, L, D, scale, nullptr, 0, p, out + g * D);
    return;
  }
  float mx[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) mx[g] = kNegInf;
  for (int64_t j = 0; j < L; ++j) {
    const float* krow = k + j * stride;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < D; ++i) dot += qg[i] * krow[i];
      const float sc = dot * scale;
      p[g * L + j] = sc;
      mx[g] = std::max(mx[g], sc);
    }
  }
  float inv[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p + g * L;
    const float m = mx[g];
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < L; ++j) {
      const float e = exp_nonpositive(pg[j] - m);
      pg[j] = e;
      total += e;
    }
    inv[g] = 1.f / total;
  }
  for (int64_t i = 0; i < G * D; ++i) out[i] = 0.f;
  for (int64_t j = 0; j < L; ++j) {
    const float* vrow = v + j * stride;
    for (int64_t g = 0; g < G; ++g) {
      const float e = p[g * L + j];
      float* og = out + g * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) og[i] += e * vrow[i];
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i) out[g * D + i] *= inv[g];
}

// out = silu(g) * u = g * sigmoid(g) * u over n features; sigmoid from e^-|g| (never overflows).
inline void silu_mul_impl(const float* g, const float* u, int64_t n, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    const float e = exp_nonpositive(-std::abs(x));
    const float sigmoid = (x >= 0.f ? 1.f : e) / (1.f + e);
    out[i] = x * sigmoid * u[i];
  }
}

}  // namespace
}  // namespace torch_lowbit

// The entry points of one build (decoder_rows.h), named by its suffix: each file that includes this header
// under its own target says TLB_DECODER_ROWS(avx2) and the like, inside namespace torch_lowbit.
#define TLB_DECODER_ROWS(isa)                                                                                      \
  void attend_row_##isa(const float* q, const float* k, const float* v, int64_t stride, int64_t L, int64_t D,      \
                        float scale, const float* mask, int64_t mask_stride, float* p, float* out) {              \
    attend_row_impl(q, k, v, stride, L, D, scale, mask, mask_stride, p, out);                                     \
  }                                                                                                               \
  void attend_group_##isa(const float* q, int64_t G, const float* k, const float* v, int64_t stride, int64_t L,   \
                          int64_t D, float scale, float* p, float* out) {                                         \
    attend_group_impl(q, G, k, v, stride, L, D, scale, p, out);                                                   \
  }                                                                                                               \
  void silu_mul_##isa(const float* g, const float* u, int64_t n, float* out) { silu_mul_impl(g, u, n, out); }
