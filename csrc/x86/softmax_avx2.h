// AVX2 softmax pieces shared by the attention kernels (kv_attention, kv_vq_attention): a vector e^x and
// the softmax numerators of a score row.
#pragma once
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "x86/sums_avx2.h"

namespace torch_lowbit {

// e^x for 8 lanes (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial; relative
// error ~2e-7 on [-88, 88]); lanes below -88.38 (where e^x < FLT_MIN: masked keys, -inf or
// transformers' finfo.min) give exactly 0, so their value rows are never rebuilt.
__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
  const __m256 underflows = _mm256_cmp_ps(x, _mm256_set1_ps(-88.3762626647949f), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflows, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)));
}

// softmax numerators, 8 keys at a time
__attribute__((target("avx2,fma"))) inline float avx2_numerators(float* s, int64_t L, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float tail = 0.f;
  for (; j < L; ++j) {
    s[j] = s[j] - mx < -88.3762626647949f ? 0.f : std::exp(s[j] - mx);  // as exp256
    tail += s[j];
  }
  return hsum(acc) + tail;
}

}  // namespace torch_lowbit
#endif
