// AVX2 lut4 kernels: vpermps only spans 8 entries, so the 16-entry lut is two ymm halves and the
// code's bit 3 selects between them with a blend.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include "common/lut4.h"
#include "common/token_blocks.h"

#define TLB_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace torch_lowbit {
namespace {

struct Lut16 {
  __m256 lo8, hi8;
};

// Looks up 8 codes (int32 lanes 0..15).
TLB_AVX2 inline __m256 lookup8(const Lut16& lut, __m256i idx) {
  const __m256 a = _mm256_permutevar8x32_ps(lut.lo8, idx);
  const __m256 b = _mm256_permutevar8x32_ps(lut.hi8, idx);
  const __m256 use_hi = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // bit 3 -> sign bit
  return _mm256_blendv_ps(a, b, use_hi);
}

struct Decoded32 {
  __m256 d[4];  // 8 weights each, in column order
};

// Decodes the 32 weights stored in 16 bytes, given the group's scale and min.
TLB_AVX2 inline Decoded32 decode32(const uint8_t* bytes16, const Lut16& lut, __m256 s, __m256 m) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes16));
  const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  Decoded32 out;
  __m256* d = out.d;
  d[0] = _mm256_fmadd_ps(lookup8(lut, _mm256_cvtepu8_epi32(lo)), s, m);
  d[1] = _mm256_fmadd_ps(lookup8(lut, _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), s, m);
  d[2] = _mm256_fmadd_ps(lookup8(lut, _mm256_cvtepu8_epi32(hi)), s, m);
  d[3] = _mm256_fmadd_ps(lookup8(lut, _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), s, m);
  return out;
}

// Calls body(k, decoded) for every 32-weight run of row n, converting group params once per group.
// Each ISA file keeps its own copy of this walk: a shared template would lack this file's `target`
// attribute, so GCC could not inline the ISA's vector code into it (a call per run instead).
template <typename Body>
TLB_AVX2 inline void for_each_run(const Lut4Weights& w, const Lut16& lut, int64_t n, Body&& body) {
  const int64_t groups = w.K / w.group;
  const uint8_t* row = w.qweight + n * (w.K / 2);
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(_cvtsh_ss(w.scales[n * groups + g].x));
    const __m256 m = _mm256_set1_ps(w.mins ? _cvtsh_ss(w.mins[n * groups + g].x) : 0.f);
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 32) body(k, decode32(row + k / 2, lut, s, m));
  }
}

TLB_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MT>
TLB_AVX2 void rows_block(const Lut4Weights& w, const Lut16& lut, const float* x, int64_t n0, int64_t n1,
                         float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
    for_each_run(w, lut, n, [&](int64_t k, const Decoded32& dec) TLB_AVX2 {
      for (int t = 0; t < MT; ++t) {
        const float* xr = x + t * w.K + k;
        for (int q = 0; q < 4; ++q) acc[t] = _mm256_fmadd_ps(dec.d[q], _mm256_loadu_ps(xr + 8 * q), acc[t]);
      }
    });
    for (int t = 0; t < MT; ++t) out[t * ldo + n] = hsum(acc[t]);
  }
}

}  // namespace

TLB_AVX2 void lut4_gemv_avx2(const Lut4Weights& w, const float* x, int64_t M, int64_t n0, int64_t n1,
                             float* out, int64_t ldo) {
  const Lut16 lut{_mm256_loadu_ps(w.lut), _mm256_loadu_ps(w.lut + 8)};
  for_token_blocks(M, [&](auto mt, int64_t m) TLB_AVX2 {
    rows_block<decltype(mt)::value>(w, lut, x + m * w.K, n0, n1, out + m * ldo, ldo);
  });
}

TLB_AVX2 void lut4_dequant_avx2(const Lut4Weights& w, int64_t n0, int64_t n1, float* dst) {
  const Lut16 lut{_mm256_loadu_ps(w.lut), _mm256_loadu_ps(w.lut + 8)};
  for (int64_t n = n0; n < n1; ++n) {
    float* row = dst + (n - n0) * w.K;
    for_each_run(w, lut, n, [&](int64_t k, const Decoded32& dec) TLB_AVX2 {
      for (int q = 0; q < 4; ++q) _mm256_storeu_ps(row + k + 8 * q, dec.d[q]);
    });
  }
}

}  // namespace torch_lowbit
#endif
