// AVX2 KV-VQ attention task (kv_vq.h): query tables built 8 entries at a time from the fp16 planes
// (F16C), each token's score from one vpgatherdd per 8 groups, softmax numerators by exp256, the value
// histogram in scalar adds (bins collide), the output as the histogram times the value planes.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <cmath>
#include <limits>

#include "common/kv_vq.h"
#include "x86/softmax_avx2.h"

#define TLB_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace torch_lowbit {

TLB_AVX2 void kv_vq_task_avx2(const KvVqTask& t) {
  const int64_t E = t.E, G = t.groups, vec = t.vec;
  float* lut = t.scratch;
  float* scores = lut + G * E;
  float* hist = scores + t.L;
  // tables: lut[g][e] = scale <k_book[g][e], q_g>, 8 entries per register from the fp16 planes
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(t.k_planes);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t e = 0; e < E; e += 8) {
      __m256 s = _mm256_setzero_ps();
      for (int64_t d = 0; d < vec; ++d) {
        const __m256 c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kp + (g * vec + d) * E + e)));
        s = _mm256_fmadd_ps(c, _mm256_set1_ps(t.q[g * vec + d] * t.scale), s);
      }
      _mm256_storeu_ps(lut + g * E + e, s);
    }
  // scores: 8 groups per gather (index code + g E)
  const __m256i step = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(E)));
  const int64_t whole = G / 8 * 8;
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < t.L; ++j) {
    const uint8_t* codes = t.k_codes + j * G;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < whole; g += 8) {
      const __m256i idx = _mm256_add_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + g))), step);
      acc = _mm256_add_ps(acc, _mm256_i32gather_ps(lut + g * E, idx, 4));
    }
    float s = hsum(acc) + (t.mask ? t.mask[j * t.mask_key_stride] : 0.f);
    for (int64_t g = whole; g < G; ++g) s += lut[g * E + codes[g]];
    scores[j] = s;
    mx = std::max(mx, s);
  }
  if (mx == -std::numeric_limits<float>::infinity()) {
    for (int64_t d = 0; d < t.D; ++d) t.out[d] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float total = avx2_numerators(scores, t.L, mx);
  for (int64_t i = 0; i < G * E; ++i) hist[i] = 0.f;
  for (int64_t j = 0; j < t.L; ++j) {
    const float p = scores[j];
    if (p == 0.f) continue;
    const uint8_t* codes = t.v_codes + j * G;
    for (int64_t g = 0; g < G; ++g) hist[g * E + codes[g]] += p;
  }
  const float inv = 1.f / total;
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(t.v_planes);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < vec; ++d) {  // out = the histogram times the value planes, 8 entries at a time
      __m256 acc = _mm256_setzero_ps();
      for (int64_t e = 0; e < E; e += 8) {
        const __m256 c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vp + (g * vec + d) * E + e)));
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(hist + g * E + e), c, acc);
      }
      t.out[g * vec + d] = hsum(acc) * inv;
    }
}

}  // namespace torch_lowbit
#endif
