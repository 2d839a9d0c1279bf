// The decode-attention task of csrc/kv_attention.cpp, written once: each path's file includes this
// and instantiates run_task<Ops> with its row operations (dequant_row, dot, axpy, numerators); the
// AVX2 file is compiled for AVX2 as a whole, so the template is too.
//   Ops::dequant_row(codes, scale, mn, D, group, bits, out)  a key / value row from its codes
//   Ops::dot(a, b, D)                                        sum a[i] * b[i]
//   Ops::axpy(e, x, y, D)                                    y += e * x
//   Ops::numerators(s, L, mx) -> total                       s[j] = exp(s[j] - mx) (0 where s[j] = -inf)
#pragma once
#include <cstring>
#include <limits>

#include "common/kv_attention.h"

namespace torch_lowbit {
namespace {

template <class Ops>
void run_task(const KvAttentionTask& t) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t row_bytes = t.D * t.bits / 8, groups = t.D / t.group;
  float mx[64], total[64];  // G <= 64 (checked by the caller)
  // row j of keys or values: exact from the ring where it holds j, else rebuilt from the codes into t.row
  auto row = [&](const float* ring, const uint8_t* codes, const uint16_t* scale, const uint16_t* mn, int64_t j) {
    if (const float* exact = kv_recent_row(ring, t, j)) return exact;
    Ops::dequant_row(codes + j * row_bytes, scale + j * groups, mn + j * groups, t.D, t.group, t.bits, t.row);
    return static_cast<const float*>(t.row);
  };
  for (int64_t g = 0; g < t.G; ++g) mx[g] = neg_inf;
  // scores: the additive mask plus q·k scale; keys masked for every head are never rebuilt (a static
  // cache's unfilled positions)
  for (int64_t j = 0; j < t.L; ++j) {
    bool any = false;
    for (int64_t g = 0; g < t.G; ++g) {
      const float m = t.mask ? t.mask[g * t.mask_head_stride + j * t.mask_key_stride] : 0.f;
      t.scores[g * t.L + j] = m;
      any |= m != neg_inf;
    }
    if (!any) continue;
    const float* krow = row(t.k_recent, t.k_codes, t.k_scale, t.k_min, j);
    for (int64_t g = 0; g < t.G; ++g) {
      float& s = t.scores[g * t.L + j];
      if (s == neg_inf) continue;
      s += Ops::dot(t.q + g * t.q_stride, krow, t.D) * t.scale;
      mx[g] = s > mx[g] ? s : mx[g];
    }
  }
  for (int64_t g = 0; g < t.G; ++g) {
    std::memset(t.out + g * t.out_stride, 0, t.D * sizeof(float));
    if (mx[g] == neg_inf) {  // every key masked: no weight anywhere (the row comes out NaN, as softmax's)
      std::memset(t.scores + g * t.L, 0, t.L * sizeof(float));
      total[g] = 0.f;
    } else {
      total[g] = Ops::numerators(t.scores + g * t.L, t.L, mx[g]);
    }
  }
  for (int64_t j = 0; j < t.L; ++j) {
    bool any = false;
    for (int64_t g = 0; g < t.G; ++g) any |= t.scores[g * t.L + j] != 0.f;
    if (!any) continue;
    const float* vrow = row(t.v_recent, t.v_codes, t.v_scale, t.v_min, j);
    for (int64_t g = 0; g < t.G; ++g) {
      const float e = t.scores[g * t.L + j];
      if (e != 0.f) Ops::axpy(e, vrow, t.out + g * t.out_stride, t.D);
    }
  }
  for (int64_t g = 0; g < t.G; ++g) {
    const float inv = total[g] > 0.f ? 1.f / total[g] : std::numeric_limits<float>::quiet_NaN();
    float* o = t.out + g * t.out_stride;
    for (int64_t i = 0; i < t.D; ++i) o[i] *= inv;
  }
}

}  // namespace
}  // namespace torch_lowbit
