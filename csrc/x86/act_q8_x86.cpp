// Vectorized Q8 activation blocks (act_q8.h): the same operations as the scalar loop, so the same
// bytes: amax / 127, x * (1 / d) rounded half-even by the default MXCSR mode (cvtps2dq), int8.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <cmath>

#include "common/act_q8.h"

namespace torch_lowbit {

__attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_act_blocks_avx512(const float* x, int64_t b0,
                                                                                       int64_t b1, int8_t* q,
                                                                                       float* d, int32_t* sum) {
  for (int64_t b = b0; b < b1; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * 32), hi = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float db = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(db != 0.f ? 1.f / db : 0.f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtsepi32_epi8(qhi));
    d[b] = db;
    sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  }
}

__attribute__((target("avx2,fma"))) void quantize_act_blocks_avx2(const float* x, int64_t b0, int64_t b1, int8_t* q,
                                                                    float* d, int32_t* sum) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = b0; b < b1; ++b) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_and_ps(v[i] = _mm256_loadu_ps(x + b * 32 + 8 * i), sign));
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float amax = 0.f;
    for (float l : lanes) amax = std::fmax(amax, l);
    const float db = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(db != 0.f ? 1.f / db : 0.f);
    __m256i s = _mm256_setzero_si256();
    alignas(32) int32_t qi[32];
    for (int i = 0; i < 4; ++i) {
      const __m256i qv = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * i), qv);
      s = _mm256_add_epi32(s, qv);
    }
    for (int j = 0; j < 32; ++j) q[b * 32 + j] = static_cast<int8_t>(qi[j]);
    alignas(32) int32_t sl[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sl), s);
    sum[b] = sl[0] + sl[1] + sl[2] + sl[3] + sl[4] + sl[5] + sl[6] + sl[7];
    d[b] = db;
  }
}

// Per-token codes (quantize_acts_per_token): q = clamp(round_half_even(x / d), qmin, qmax) for one
// token's K values, 8 at a time (a true division, as torch's, so the codes equal the scalar loop's).
__attribute__((target("avx2,fma"))) void quantize_token_avx2(const float* x, int64_t K, float d, int qmin, int qmax,
                                                               int8_t* q) {
  const __m256 dv = _mm256_set1_ps(d), lo = _mm256_set1_ps(static_cast<float>(qmin)),
               hi = _mm256_set1_ps(static_cast<float>(qmax));
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i v = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(w, w));
  }
}

}  // namespace torch_lowbit
#endif
