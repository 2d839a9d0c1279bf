// The portable KV-VQ attention task (kv_vq.h).
#include <cmath>
#include <limits>

#include "common/kv_vq.h"

namespace torch_lowbit {

void kv_vq_task_scalar(const KvVqTask& t) {
  const int64_t E = t.E, G = t.groups, vec = t.vec;
  float* lut = t.scratch;
  float* scores = lut + G * E;
  float* hist = scores + t.L;
  for (int64_t g = 0; g < G; ++g) {
    float* row = lut + g * E;
    for (int64_t e = 0; e < E; ++e) row[e] = 0.f;
    for (int64_t d = 0; d < vec; ++d) {
      const c10::Half* plane = t.k_planes + (g * vec + d) * E;
      const float qd = t.q[g * vec + d] * t.scale;
      for (int64_t e = 0; e < E; ++e) row[e] += static_cast<float>(plane[e]) * qd;
    }
  }
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < t.L; ++j) {
    const uint8_t* codes = t.k_codes + j * G;
    float s = t.mask ? t.mask[j * t.mask_key_stride] : 0.f;
    for (int64_t g = 0; g < G; ++g) s += lut[g * E + codes[g]];
    scores[j] = s;
    mx = std::max(mx, s);
  }
  if (mx == -std::numeric_limits<float>::infinity()) {  // no key visible: NaN, as softmax over all -inf
    for (int64_t d = 0; d < t.D; ++d) t.out[d] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  for (int64_t i = 0; i < G * E; ++i) hist[i] = 0.f;
  float total = 0.f;
  for (int64_t j = 0; j < t.L; ++j) {
    const float p = scores[j] - mx < -88.3762626647949f ? 0.f : std::exp(scores[j] - mx);
    total += p;
    if (p == 0.f) continue;
    const uint8_t* codes = t.v_codes + j * G;
    for (int64_t g = 0; g < G; ++g) hist[g * E + codes[g]] += p;
  }
  const float inv = 1.f / total;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < vec; ++d) {
      const c10::Half* plane = t.v_planes + (g * vec + d) * E;
      float acc = 0.f;
      for (int64_t e = 0; e < E; ++e) acc += hist[g * E + e] * static_cast<float>(plane[e]);
      t.out[g * vec + d] = acc * inv;
    }
}

}  // namespace torch_lowbit
