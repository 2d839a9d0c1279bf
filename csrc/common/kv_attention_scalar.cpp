// Portable KV-cache decode attention: the reference the ISA paths are tested against (and the
// path for group sizes the vector code does not take).
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/kv_attention_task.h"

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

}  // namespace

void kv_attention_task_scalar(const KvAttentionTask& t) { run_task<ScalarOps>(t); }

}  // namespace torch_lowbit
