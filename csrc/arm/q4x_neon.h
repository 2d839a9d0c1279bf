// Shared by the ARM kernels of the interleaved q4_{R}x{S} layouts (common/q4x.h): q4x_dotprod.cpp (S = 4,
// sdot by lane) and q4x_i8mm.cpp (S = 8, smmla), each including it after its target pragma. The float
// epilogue is the scalar kernel's (common/q4x_scalar.cpp), four rows per vector, so every path agrees
// bit for bit.
#pragma once
#include <arm_neon.h>

#include <algorithm>

#include "common/q4x.h"

namespace torch_lowbit {
namespace {

// A 16-byte load of interleaved code bytes -> the signed values of its low and high nibbles. Toggled
// nibbles (t = c - 8 stored as c ^ 8) come out as t * 16 from one shift / mask (the caller shifts the
// int32 sums right by 4, exactly); other tables are looked up (tbl) as t.
template <bool TOGGLED>
inline void split_nibbles(uint8x16_t v, int8x16_t table, int8x16_t& lo, int8x16_t& hi) {
  if constexpr (TOGGLED) {
    lo = vreinterpretq_s8_u8(vshlq_n_u8(v, 4));
    hi = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0xF0)));
  } else {
    lo = vqtbl1q_s8(table, vandq_u8(v, vdupq_n_u8(15)));
    hi = vqtbl1q_s8(table, vshrq_n_u8(v, 4));
  }
}

// One token's accumulators for Q quads of rows: the running sums (from the bias) and a group's float
// (per-32 activations) or int32 (per-token activations) sums.
template <int Q>
struct TokenAcc {
  float32x4_t acc[Q], gacc[Q];
  int32x4_t gisum[Q];

  void start(const Q4xWeights& w, int64_t rg) {
    float bias[8] = {0};
    const int64_t rows = std::min<int64_t>(4 * Q, w.N - rg * 4 * Q);
    for (int64_t r = 0; r < rows && w.bias; ++r) bias[r] = w.bias[rg * 4 * Q + r];
    for (int q = 0; q < Q; ++q) acc[q] = vld1q_f32(bias + 4 * q);
  }
  void start_group() {
    for (int q = 0; q < Q; ++q) {
      gacc[q] = vdupq_n_f32(0.f);
      gisum[q] = vdupq_n_s32(0);
    }
  }
  // isum: rows 4q .. 4q+3 of one block (exact integers); xd: the block's activation scale
  void add_block(int q, int32x4_t isum, const Q8Acts& a, float xd) {
    if (a.per_token)
      gisum[q] = vaddq_s32(gisum[q], isum);
    else
      gacc[q] = vfmaq_f32(gacc[q], vcvtq_f32_s32(isum), vdupq_n_f32(xd));
  }
  void end_group(const Q4xWeights& w, const Q8Acts& a, int64_t m, int64_t rg, int64_t g) {
    const int64_t groups = w.K / w.group;
    const auto* sp = reinterpret_cast<const float16_t*>(w.scales + (rg * groups + g) * 4 * Q);
    for (int q = 0; q < Q; ++q) {
      if (a.per_token) gacc[q] = vmulq_f32(vcvtq_f32_s32(gisum[q]), vdupq_n_f32(a.d[m * (w.K / 32)]));
      acc[q] = vfmaq_f32(acc[q], gacc[q], vcvt_f32_f16(vld1_f16(sp + 4 * q)));
    }
  }
  void store(const Q4xWeights& w, int64_t rg, float* out_row) const {
    float res[8];
    for (int q = 0; q < Q; ++q) vst1q_f32(res + 4 * q, acc[q]);
    const int64_t rows = std::min<int64_t>(4 * Q, w.N - rg * 4 * Q);
    for (int64_t r = 0; r < rows; ++r) out_row[rg * 4 * Q + r] = res[r];
  }
};

// Calls f(std::integral_constant<bool, toggled>, std::integral_constant<int, R>) for the weights' form.
template <typename F>
inline void with_q4x_form(const Q4xWeights& w, F&& f) {
  if (w.toggled) {
    if (w.rows == 8) return f(std::true_type{}, std::integral_constant<int, 8>{});
    return f(std::true_type{}, std::integral_constant<int, 4>{});
  }
  if (w.rows == 8) return f(std::false_type{}, std::integral_constant<int, 8>{});
  f(std::false_type{}, std::integral_constant<int, 4>{});
}

}  // namespace
}  // namespace torch_lowbit
