// AVX-512 lut4 kernels: the 16-entry lut lives in one zmm register and vpermps decodes 16 codes
// at a time. (The int8-activation VNNI kernels over interleaved layouts are a separate family.)
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <algorithm>

#include "common/lut4.h"
#include "common/token_blocks.h"

#define TLB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

namespace torch_lowbit {
namespace {

struct Decoded32 {
  __m512 lo, hi;  // weights k..k+15 and k+16..k+31
};

// Decodes the 32 weights stored in 16 bytes, given the group's scale and min.
TLB_AVX512 inline Decoded32 decode32(const uint8_t* bytes16, __m512 lut, __m512 s, __m512 m) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes16));
  const __m512i lo_idx = _mm512_cvtepu8_epi32(bytes);                       // vpermps reads 4 low bits
  const __m512i hi_idx = _mm512_cvtepu8_epi32(_mm_srli_epi16(bytes, 4));    // high nibble -> low bits
  return {_mm512_fmadd_ps(_mm512_permutexvar_ps(lo_idx, lut), s, m),
          _mm512_fmadd_ps(_mm512_permutexvar_ps(hi_idx, lut), s, m)};
}

// Calls body(k, decoded) for every 32-weight run of row n, converting group params once per group.
// Each ISA file keeps its own copy of this walk: a shared template would lack this file's `target`
// attribute, so GCC could not inline the ISA's vector code into it (a call per run instead).
template <typename Body>
TLB_AVX512 inline void for_each_run(const Lut4Weights& w, __m512 lut, int64_t n, Body&& body) {
  const int64_t groups = w.K / w.group;
  const uint8_t* row = w.qweight + n * (w.K / 2);
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = _mm512_set1_ps(_cvtsh_ss(w.scales[n * groups + g].x));
    const __m512 m = _mm512_set1_ps(w.mins ? _cvtsh_ss(w.mins[n * groups + g].x) : 0.f);
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 32) body(k, decode32(row + k / 2, lut, s, m));
  }
}

template <int MT>
TLB_AVX512 void rows_block(const Lut4Weights& w, __m512 lut, const float* x, int64_t n0, int64_t n1,
                           float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
    for_each_run(w, lut, n, [&](int64_t k, const Decoded32& d) TLB_AVX512 {
      for (int t = 0; t < MT; ++t) {
        const float* xr = x + t * w.K + k;
        acc[t] = _mm512_fmadd_ps(d.lo, _mm512_loadu_ps(xr), acc[t]);
        acc[t] = _mm512_fmadd_ps(d.hi, _mm512_loadu_ps(xr + 16), acc[t]);
      }
    });
    for (int t = 0; t < MT; ++t) out[t * ldo + n] = _mm512_reduce_add_ps(acc[t]);
  }
}

}  // namespace

TLB_AVX512 void lut4_gemv_avx512(const Lut4Weights& w, const float* x, int64_t M, int64_t n0,
                                 int64_t n1, float* out, int64_t ldo) {
  const __m512 lut = _mm512_loadu_ps(w.lut);
  for_token_blocks(M, [&](auto mt, int64_t m) TLB_AVX512 {
    rows_block<decltype(mt)::value>(w, lut, x + m * w.K, n0, n1, out + m * ldo, ldo);
  });
}

TLB_AVX512 void lut4_dequant_avx512(const Lut4Weights& w, int64_t n0, int64_t n1, float* dst) {
  const __m512 lut = _mm512_loadu_ps(w.lut);
  for (int64_t n = n0; n < n1; ++n) {
    float* row = dst + (n - n0) * w.K;
    for_each_run(w, lut, n, [&](int64_t k, const Decoded32& d) TLB_AVX512 {
      _mm512_storeu_ps(row + k, d.lo);
      _mm512_storeu_ps(row + k + 16, d.hi);
    });
  }
}

}  // namespace torch_lowbit
#endif
