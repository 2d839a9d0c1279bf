// Portable KV-cache decode attention: the reference the ISA paths are tested against (and the
// path for group sizes the vector code does not take).
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/kv_attention.h"

namespace torch_lowbit {
namespace {

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

void dequant_row(const uint8_t* codes, const uint16_t* scale, const uint16_t* mn, int64_t D, int64_t group,
                 int bits, float* out) {
  for (int64_t i = 0; i < D; ++i) {
    const int c = bits == 4 ? (codes[i >> 1] >> ((i & 1) * 4)) & 15 : codes[i];
    out[i] = static_cast<float>(c) * half_to_float(scale[i / group]) + half_to_float(mn[i / group]);
  }
}

}  // namespace

void kv_attention_task_scalar(const KvAttentionTask& t) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t row_bytes = t.D * t.bits / 8, groups = t.D / t.group;
  float mx[64];  // G <= 64 (checked by the caller)
  for (int64_t g = 0; g < t.G; ++g) mx[g] = neg_inf;
  for (int64_t j = 0; j < t.L; ++j) {
    bool any = false;
    for (int64_t g = 0; g < t.G; ++g) {
      const float m = t.mask ? t.mask[g * t.mask_head_stride + j * t.mask_key_stride] : 0.f;
      t.scores[g * t.L + j] = m;  // the additive mask for now, the score below
      any |= m != neg_inf;
    }
    if (!any) continue;  // e.g. the unfilled positions of a static cache: no row to rebuild
    const float* krow = kv_recent_row(t.k_recent, t, j);
    if (!krow) {
      dequant_row(t.k_codes + j * row_bytes, t.k_scale + j * groups, t.k_min + j * groups, t.D, t.group, t.bits, t.row);
      krow = t.row;
    }
    for (int64_t g = 0; g < t.G; ++g) {
      float& s = t.scores[g * t.L + j];
      if (s == neg_inf) continue;
      const float* q = t.q + g * t.q_stride;
      float dot = 0.f;
      for (int64_t i = 0; i < t.D; ++i) dot += q[i] * krow[i];
      s += dot * t.scale;
      mx[g] = std::max(mx[g], s);
    }
  }
  float total[64];
  for (int64_t g = 0; g < t.G; ++g) {
    total[g] = 0.f;
    std::fill(t.out + g * t.out_stride, t.out + g * t.out_stride + t.D, 0.f);
  }
  for (int64_t j = 0; j < t.L; ++j) {
    bool any = false;
    for (int64_t g = 0; g < t.G; ++g) {
      float& s = t.scores[g * t.L + j];
      s = mx[g] == neg_inf ? 0.f : std::exp(s - mx[g]);
      total[g] += s;
      any |= s != 0.f;
    }
    if (!any) continue;
    const float* vrow = kv_recent_row(t.v_recent, t, j);
    if (!vrow) {
      dequant_row(t.v_codes + j * row_bytes, t.v_scale + j * groups, t.v_min + j * groups, t.D, t.group, t.bits, t.row);
      vrow = t.row;
    }
    for (int64_t g = 0; g < t.G; ++g) {
      const float e = t.scores[g * t.L + j];
      if (e == 0.f) continue;
      float* o = t.out + g * t.out_stride;
      for (int64_t i = 0; i < t.D; ++i) o[i] += e * vrow[i];
    }
  }
  for (int64_t g = 0; g < t.G; ++g) {
    const float inv = total[g] > 0.f ? 1.f / total[g] : std::numeric_limits<float>::quiet_NaN();
    float* o = t.out + g * t.out_stride;
    for (int64_t i = 0; i < t.D; ++i) o[i] *= inv;
  }
}

}  // namespace torch_lowbit
