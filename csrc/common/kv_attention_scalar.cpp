// Portable KV-cache attention: the reference the ISA paths are tested against (and the
// path for group sizes the vector code does not take).
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/kv_attention.h"

namespace torch_lowbit {
namespace {

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

struct ScalarOps {
  static void dequant_row(const uint8_t* codes, const uint16_t* scale, const uint16_t* mn, int64_t D, int64_t group,
                          int bits, float* out) {
    for (int64_t i = 0; i < D; ++i) {
      const int c = bits == 4 ? (codes[i >> 1] >> ((i & 1) * 4)) & 15 : codes[i];
      out[i] = static_cast<float>(c) * half_to_float(scale[i / group]) + half_to_float(mn[i / group]);
    }
  }
  static float dot(const float* a, const float* b, int64_t D) {
    float s = 0.f;
    for (int64_t i = 0; i < D; ++i) s += a[i] * b[i];
    return s;
  }
  static void axpy(float e, const float* x, float* y, int64_t D) {
    for (int64_t i = 0; i < D; ++i) y[i] += e * x[i];
  }
  static float numerators(float* s, int64_t L, float mx) {
    float total = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      s[j] = s[j] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(s[j] - mx);
      total += s[j];
    }
    return total;
  }
};

// One task, two passes over the keys: scores (and their max per query), softmax numerators, then the
// values weighted by them. Every key or value row the task's queries use is rebuilt once.
void run_task(const KvAttentionTask& t) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t row_bytes = t.D * t.bits / 8, groups = t.D / t.group, Q = t.queries();
  float mx[kKvMaxQueries], total[kKvMaxQueries];  // Q <= kKvMaxQueries (checked by the caller)
  // row j of keys or values: exact from the ring where it holds j, else rebuilt from the codes into t.row
  auto row = [&](const float* ring, const uint8_t* codes, const uint16_t* scale, const uint16_t* mn, int64_t j) {
    if (const float* exact = kv_recent_row(ring, t, j)) return exact;
    ScalarOps::dequant_row(codes + j * row_bytes, scale + j * groups, mn + j * groups, t.D, t.group, t.bits, t.row);
    return static_cast<const float*>(t.row);
  };
  for (int64_t h = 0; h < Q; ++h) mx[h] = neg_inf;
  // scores: the additive mask plus q·k scale; keys masked for every query are never rebuilt (a static
  // cache's unfilled positions, the future of a prompt block's first rows)
  for (int64_t j = 0; j < t.L; ++j) {
    bool any = false;
    for (int64_t h = 0; h < Q; ++h) {
      const float m = t.mask_at(h, j);
      t.scores[h * t.L + j] = m;
      any |= m != neg_inf;
    }
    if (!any) continue;
    const float* krow = row(t.k_recent, t.k_codes, t.k_scale, t.k_min, j);
    for (int64_t h = 0; h < Q; ++h) {
      float& s = t.scores[h * t.L + j];
      if (s == neg_inf) continue;
      s += ScalarOps::dot(t.query(h), krow, t.D) * t.scale;
      mx[h] = s > mx[h] ? s : mx[h];
    }
  }
  for (int64_t h = 0; h < Q; ++h) {
    std::memset(t.output(h), 0, t.D * sizeof(float));
    if (mx[h] == neg_inf) {  // every key masked: no weight anywhere (the row comes out NaN, as softmax's)
      std::memset(t.scores + h * t.L, 0, t.L * sizeof(float));
      total[h] = 0.f;
    } else {
      total[h] = ScalarOps::numerators(t.scores + h * t.L, t.L, mx[h]);
    }
  }
  for (int64_t j = 0; j < t.L; ++j) {
    bool any = false;
    for (int64_t h = 0; h < Q; ++h) any |= t.scores[h * t.L + j] != 0.f;
    if (!any) continue;
    const float* vrow = row(t.v_recent, t.v_codes, t.v_scale, t.v_min, j);
    for (int64_t h = 0; h < Q; ++h) {
      const float e = t.scores[h * t.L + j];
      if (e != 0.f) ScalarOps::axpy(e, vrow, t.output(h), t.D);
    }
  }
  for (int64_t h = 0; h < Q; ++h) {
    const float inv = total[h] > 0.f ? 1.f / total[h] : std::numeric_limits<float>::quiet_NaN();
    float* o = t.output(h);
    for (int64_t i = 0; i < t.D; ++i) o[i] *= inv;
  }
}

}  // namespace

void kv_attention_task_scalar(const KvAttentionTask& t) { run_task(t); }

}  // namespace torch_lowbit
