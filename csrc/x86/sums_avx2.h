// AVX2 horizontal sums shared by the x86 kernels: one register's lanes, and eight registers at once.
#pragma once
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

namespace torch_lowbit {

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 8 sums of a0..a7 (lane k: the sum of a_k's lanes).
__attribute__((target("avx2,fma"))) inline __m256 sums8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

}  // namespace torch_lowbit
#endif
