// AVX2 KV-cache decode attention (same task as common/kv_attention_scalar.cpp). A 4-bit row is
// rebuilt 8 channels at a time: the 4 code bytes are broadcast to 8 lanes and shifted right by
// 0, 4, ..., 28 (vpsrlvd), which puts channel i's nibble in lane i (low nibble = even channel);
// masked, converted and scaled with one FMA (code * d + m). 8-bit rows: vpmovzxbd. The rebuilt row
// stays in L1 and is used by every query head of the KV head's group.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "common/kv_attention.h"  // before the target pragma: shared inline code stays baseline x86-64

// The rest of the file is AVX2 code, common/kv_attention_task.h's template included (it has
// internal linkage, so no baseline caller can end up with this copy).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "common/kv_attention_task.h"

#define TLB_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace torch_lowbit {
namespace {

TLB_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

TLB_AVX2 inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

TLB_AVX2 void avx2_dequant_row(const uint8_t* codes, const uint16_t* scale, const uint16_t* mn, int64_t D, int64_t group,
                          int bits, float* out) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nib = _mm256_set1_epi32(15);
  for (int64_t g0 = 0; g0 < D; g0 += group) {
    const __m256 d = _mm256_set1_ps(half_to_float(scale[g0 / group]));
    const __m256 m = _mm256_set1_ps(half_to_float(mn[g0 / group]));
    for (int64_t i = g0; i < g0 + group; i += 8) {
      __m256i c;
      if (bits == 4) {
        uint32_t word;
        std::memcpy(&word, codes + i / 2, 4);
        c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts), nib);
      } else {
        c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
      }
      _mm256_storeu_ps(out + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), d, m));
    }
  }
}

TLB_AVX2 float avx2_dot(const float* a, const float* b, int64_t D) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i < D; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
}

// e^x for 8 lanes (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial; relative
// error ~2e-7 on [-88, 88]); lanes equal to -inf give exactly 0 (masked keys).
TLB_AVX2 inline __m256 exp256(__m256 x) {
  const __m256 is_neg_inf = _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
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
  return _mm256_andnot_ps(is_neg_inf, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)));
}

TLB_AVX2 void avx2_axpy(float e, const float* x, float* y, int64_t D) {
  const __m256 ev = _mm256_set1_ps(e);
  for (int64_t i = 0; i < D; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(ev, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

// softmax numerators, 8 keys at a time
TLB_AVX2 float avx2_numerators(float* s, int64_t L, float mx) {
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
    s[j] = s[j] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(s[j] - mx);
    tail += s[j];
  }
  return hsum(acc) + tail;
}

struct Avx2Ops {
  static void dequant_row(const uint8_t* codes, const uint16_t* scale, const uint16_t* mn, int64_t D, int64_t group,
                          int bits, float* out) {
    avx2_dequant_row(codes, scale, mn, D, group, bits, out);
  }
  static float dot(const float* a, const float* b, int64_t D) { return avx2_dot(a, b, D); }
  static void axpy(float e, const float* x, float* y, int64_t D) { avx2_axpy(e, x, y, D); }
  static float numerators(float* s, int64_t L, float mx) { return avx2_numerators(s, L, mx); }
};

}  // namespace

void kv_attention_task_avx2(const KvAttentionTask& t) { run_task<Avx2Ops>(t); }
#pragma GCC pop_options

}  // namespace torch_lowbit
#endif  // TORCH_LOWBIT_X86
