// Vectorized Q8 activation blocks (act_q8.h): the same operations as the scalar loop, so the same
// bytes: amax / 127, x * (1 / d) rounded half-even by the default MXCSR mode (cvtps2dq), int8.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <cmath>

#include "common/act_q8.h"

namespace torch_lowbit {

#define TLB_HMAX_TARGET __attribute__((target("avx2,fma")))

namespace {

template <bool Max>
TLB_HMAX_TARGET inline __m128 max_or_min4(__m128 a, __m128 b) {
  return Max ? _mm_max_ps(a, b) : _mm_min_ps(a, b);
}

// The largest (or smallest) of 8 floats.
template <bool Max>
TLB_HMAX_TARGET inline float reduce8(__m256 v) {
  __m128 m = max_or_min4<Max>(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = max_or_min4<Max>(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(max_or_min4<Max>(m, _mm_shuffle_ps(m, m, 1)));
}

TLB_HMAX_TARGET inline float hmax8(__m256 v) { return reduce8<true>(v); }
TLB_HMAX_TARGET inline float hmin8(__m256 v) { return reduce8<false>(v); }

}  // namespace

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
    const float db = hmax8(m) / 127.f;
    const __m256 inv = _mm256_set1_ps(db != 0.f ? 1.f / db : 0.f);
    __m256i s = _mm256_setzero_si256(), qv[4];
    for (int i = 0; i < 4; ++i) s = _mm256_add_epi32(s, qv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
    // |codes| <= 127: the saturating packs keep them; they interleave 128-bit lanes, the permute undoes it
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qv[0], qv[1]), _mm256_packs_epi32(qv[2], qv[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
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

// Sub-block activations (quantize_sub_block32, the same operations lane by lane, so the same bytes):
// the amaxes by vector max, the kb search with 8 candidates per vector (lane i: kb = kmax - i; the
// first least worst mismatch in that order is the scalar loop's strict-less scan), the codes times
// k_j in float (exact small integers) packed to int8.
__attribute__((target("avx2,fma"))) void quantize_sub_blocks_avx2(const float* x, int64_t b0, int64_t b1, int sub,
                                                                    int bits, float ratio, int8_t* q, float* d,
                                                                    int32_t* sum) {
  const int qmax = (1 << (bits - 1)) - 1, kmax = 127 / (qmax + 1), n = 32 / sub;
  const int candidates = kmax - kmax / 2, vectors = (candidates + 7) / 8;  // 8, 16 or 32 kb values
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), one = _mm256_set1_ps(1.f),
               kmaxv = _mm256_set1_ps(static_cast<float>(kmax)), lo = _mm256_set1_ps(static_cast<float>(-qmax - 1)),
               hi = _mm256_set1_ps(static_cast<float>(qmax)), inf = _mm256_set1_ps(INFINITY);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = x + b * 32;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    float s[4], smax = 0.f;
    for (int j = 0; j < n; ++j) {
      const int per = sub / 8;  // vectors per sub-block
      __m256 m = _mm256_and_ps(v[j * per], absmask);
      if (per == 2) m = _mm256_max_ps(m, _mm256_and_ps(v[j * per + 1], absmask));
      s[j] = hmax8(m) * ratio;
      smax = std::max(smax, s[j]);
    }
    int k[4] = {1, 1, 1, 1};
    float db = 1.f;
    if (smax > 0.f) {
      __m256 worst[4];
      __m256 least = inf;
      for (int c = 0; c < vectors; ++c) {
        const __m256i kb = _mm256_sub_epi32(_mm256_set1_epi32(kmax - 8 * c), lane);
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(kb, _mm256_set1_epi32(kmax / 2)));
        const __m256 dc = _mm256_div_ps(_mm256_set1_ps(smax), _mm256_cvtepi32_ps(kb));
        __m256 w = _mm256_setzero_ps();
        for (int j = 0; j < n; ++j) {
          if (!(s[j] > 0.f)) continue;
          const __m256 sj = _mm256_set1_ps(s[j]);
          const __m256 kf = _mm256_round_ps(_mm256_div_ps(sj, dc), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          const __m256 kc = _mm256_blendv_ps(one, _mm256_min_ps(kf, kmaxv), _mm256_cmp_ps(kf, one, _CMP_GE_OQ));
          __m256 p = _mm256_mul_ps(kc, dc);
          __asm__("" : "+x"(p));  // no fused multiply-subtract: the scalar code rounds the product first
          const __m256 e = _mm256_div_ps(_mm256_and_ps(_mm256_sub_ps(p, sj), absmask), sj);
          w = _mm256_max_ps(w, e);
        }
        worst[c] = _mm256_blendv_ps(inf, w, valid);
        least = _mm256_min_ps(least, worst[c]);
      }
      const __m256 best = _mm256_set1_ps(hmin8(least));
      int kb = kmax;
      for (int c = 0; c < vectors; ++c) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(worst[c], best, _CMP_EQ_OQ));
        if (hit) {
          kb = kmax - 8 * c - __builtin_ctz(hit);
          break;
        }
      }
      db = smax / static_cast<float>(kb);
      for (int j = 0; j < n; ++j) {
        const float kf = std::nearbyint(s[j] / db);
        k[j] = kf >= 1.f ? static_cast<int>(std::min<float>(kf, kmax)) : 1;
      }
    }
    __m256i total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const int j = i * 8 / sub;
      const __m256 kv = _mm256_set1_ps(static_cast<float>(k[j]));
      const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], _mm256_mul_ps(kv, _mm256_set1_ps(db))),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_min_ps(_mm256_max_ps(r, lo), hi), kv));
      total = _mm256_add_epi32(total, c);
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + b * 32 + 8 * i), _mm_packs_epi16(w, w));
    }
    alignas(32) int32_t tl[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tl), total);
    sum[b] = tl[0] + tl[1] + tl[2] + tl[3] + tl[4] + tl[5] + tl[6] + tl[7];
    d[b] = db;
  }
}

}  // namespace torch_lowbit
#endif
