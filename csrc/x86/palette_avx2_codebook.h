// The AVX2 codebook kernels' building blocks (palette_avx2.cpp says how they work), shared by the
// translation units that instantiate them: the fused GEMV's (dimension, code bits) cases are spread
// over palette_avx2_*.cpp so a parallel build compiles them at once (one file held them all: 160 s
// of a build's critical path on one core).
#pragma once
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <algorithm>
#include <utility>

#include "common/palette.h"
#include "common/token_blocks.h"

#define TLB_AVX2 __attribute__((target("avx2,fma")))
#define TLB_INLINE __attribute__((always_inline)) inline

namespace torch_lowbit {
namespace palette_avx2 {


constexpr int kMaxTokenBlock = 4;

// All-ones in lanes [0, n), for maskload / maskstore.
TLB_AVX2 inline __m256i first_lanes(int64_t n) {
  const int k = static_cast<int>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

TLB_AVX2 inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// ---- codebook formats --------------------------------------------------------------------------

// Codes 16 v + 8 h .. 16 v + 8 h + 7 of a row (streams 8 h .. 8 h + 7), stream bits above each code.
TLB_AVX2 inline __m256i stream_codes(const uint32_t* row, int64_t v, int h, int bits) {
  const int64_t pos = v * bits, w = pos >> 5;
  const int o = static_cast<int>(pos & 31);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + w * kCodeStreams + 8 * h));
  if (o + bits <= 32) return _mm256_srl_epi32(a, _mm_cvtsi32_si128(32 - bits - o));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (w + 1) * kCodeStreams + 8 * h));
  return _mm256_or_si256(_mm256_sll_epi32(a, _mm_cvtsi32_si128(o + bits - 32)),
                         _mm256_srl_epi32(b, _mm_cvtsi32_si128(64 - o - bits)));
}

// The same for code vector U, half H of a period (32 code vectors = B words per stream), all
// compile-time: immediate shifts, no address arithmetic.
template <int B, int U, int H>
TLB_AVX2 TLB_INLINE __m256i period_codes(const uint32_t* period) {
  constexpr int pos = U * B, w = pos >> 5, o = pos & 31;
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(period + w * kCodeStreams + 8 * H));
  if constexpr (o + B <= 32) {
    return _mm256_srli_epi32(a, 32 - B - o);
  } else {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(period + (w + 1) * kCodeStreams + 8 * H));
    return _mm256_or_si256(_mm256_slli_epi32(a, o + B - 32), _mm256_srli_epi32(b, 64 - o - B));
  }
}

enum Lookup { kPerm8 = 0, kPerm16 = 1, kPerm32 = 2, kGather = 3 };

constexpr int lookup_kind(int code_bits) {
  return code_bits <= 3 ? kPerm8 : code_bits == 4 ? kPerm16 : kGather;
}

struct PlaneTable {
  __m256 t[4];  // entries repeated with period 2^b: a code with stream bits above it finds its entry
  __m256i index_mask;
  const float* plane;
};

TLB_AVX2 inline PlaneTable plane_table(const float* plane, int64_t entries) {
  PlaneTable p;
  p.plane = plane;
  p.index_mask = _mm256_set1_epi32(static_cast<int>(entries - 1));
  alignas(32) float periodic[32];
  for (int e = 0; e < 32; ++e) periodic[e] = plane[e % entries];
  for (int q = 0; q < 4; ++q) p.t[q] = _mm256_load_ps(periodic + 8 * q);
  return p;
}

// vblendvps selects on the sign bit: move code bit `bit` there.
template <int bit>
TLB_AVX2 TLB_INLINE __m256 select_on(__m256i code, __m256 zero, __m256 one) {
  return _mm256_blendv_ps(zero, one, _mm256_castsi256_ps(_mm256_slli_epi32(code, 31 - bit)));
}

template <int LK>
TLB_AVX2 TLB_INLINE __m256 lookup(const PlaneTable& p, __m256i code) {
  if constexpr (LK == kPerm8) {
    return _mm256_permutevar8x32_ps(p.t[0], code);
  } else if constexpr (LK == kPerm16) {
    return select_on<3>(code, _mm256_permutevar8x32_ps(p.t[0], code), _mm256_permutevar8x32_ps(p.t[1], code));
  } else if constexpr (LK == kPerm32) {
    const __m256 low = select_on<3>(code, _mm256_permutevar8x32_ps(p.t[0], code), _mm256_permutevar8x32_ps(p.t[1], code));
    const __m256 high = select_on<3>(code, _mm256_permutevar8x32_ps(p.t[2], code), _mm256_permutevar8x32_ps(p.t[3], code));
    return select_on<4>(code, low, high);
  } else {
    return _mm256_i32gather_ps(p.plane, _mm256_and_si256(code, p.index_mask), 4);
  }
}

// Independent accumulator sets: a single token needs more FMA chains than tokens x coordinates give.
template <int MB, int D>
constexpr int kAccSets = MB * D <= 4 ? 2 : 1;

// acc[m][c] += table_c[code] * x'-plane c of token m0 + m, 8 codes from j (lanes where `valid` is 0
// read no activation and add 0).
template <int MB, int D, int LK, bool kMasked>
TLB_AVX2 TLB_INLINE void codebook_fma(__m256 (&acc)[MB][D], const PlaneTable* tab, __m256i code, const float* acts,
                                      int64_t M, int64_t m0, int64_t codes, int64_t j, __m256i valid) {
  for (int c = 0; c < D; ++c) {
    const __m256 val = lookup<LK>(tab[c], code);
    for (int m = 0; m < MB; ++m) {
      const float* xp = acts + (c * M + m0 + m) * codes + j;
      const __m256 xv = kMasked ? _mm256_maskload_ps(xp, valid) : _mm256_loadu_ps(xp);
      acc[m][c] = _mm256_fmadd_ps(val, xv, acc[m][c]);
    }
  }
}

// One period (32 code vectors, 512 codes from j0), fully unrolled; the halves alternate sets.
template <int MB, int D, int B, size_t... U>
TLB_AVX2 TLB_INLINE void period_fma(__m256 (&acc)[kAccSets<MB, D>][MB][D], const PlaneTable* tab,
                                    const uint32_t* period, const float* acts, int64_t M, int64_t m0, int64_t codes,
                                    int64_t j0, std::index_sequence<U...>) {
  constexpr int LK = lookup_kind(B), last = kAccSets<MB, D> - 1;
  const __m256i all = _mm256_set1_epi32(-1);
  ((codebook_fma<MB, D, LK, false>(acc[0], tab, period_codes<B, U, 0>(period), acts, M, m0, codes, j0 + 16 * U, all),
    codebook_fma<MB, D, LK, false>(acc[last], tab, period_codes<B, U, 1>(period), acts, M, m0, codes,
                                   j0 + 16 * U + 8, all)),
   ...);
}

// Rows [n0, n1) for tokens [m0, m0 + MB): whole periods unrolled, the row's last < 512 codes at
// run time (masked past the row's end).
template <int MB, int D, int B>
TLB_AVX2 void codebook_rows(const CodebookWeights& w, const float* acts, int64_t M, int64_t m0, int64_t n0, int64_t n1,
                            float* out) {
  constexpr int LK = lookup_kind(B), kSets = kAccSets<MB, D>;
  constexpr int64_t kPeriodCodes = 32 * kCodeStreams, kPeriodWords = B * kCodeStreams;
  const int64_t entries = int64_t{1} << B, codes = w.K / D, vectors = (codes + 15) / 16;
  const int64_t periods = codes / kPeriodCodes;
  PlaneTable tab[D];
  for (int c = 0; c < D; ++c) tab[c] = plane_table(w.planes + c * entries, entries);
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* row = w.words + n * w.row_words;
    __m256 acc[kSets][MB][D];
    for (int s = 0; s < kSets; ++s)
      for (int m = 0; m < MB; ++m)
        for (int c = 0; c < D; ++c) acc[s][m][c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < periods; ++p)
      period_fma<MB, D, B>(acc, tab, row + p * kPeriodWords, acts, M, m0, codes, p * kPeriodCodes,
                           std::make_index_sequence<32>{});
    for (int64_t v = periods * 32; v < vectors; ++v)
      for (int h = 0; h < 2; ++h) {
        const int64_t j = 16 * v + 8 * h;
        if (j < codes)
          codebook_fma<MB, D, LK, true>(acc[0], tab, stream_codes(row, v, h, B), acts, M, m0, codes, j,
                                        first_lanes(codes - j));
      }
    const float scale = static_cast<float>(w.scales[n]), bias = w.bias ? w.bias[n] : 0.f;
    for (int m = 0; m < MB; ++m) {
      __m256 sum = acc[0][m][0];
      for (int s = 0; s < kSets; ++s)
        for (int c = 0; c < D; ++c)
          if (s + c > 0) sum = _mm256_add_ps(sum, acc[s][m][c]);
      out[(m0 + m) * w.N + n] = horizontal_sum(sum) * scale + bias;
    }
  }
}

// The fused GEMV of rows [n0, n1) for every token, dimension D and B-bit codes.
template <int D, int B>
void codebook_gemv_rows(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1, float* out) {
  for_token_blocks<kMaxTokenBlock>(M, [&](auto T, int64_t m0) {
    codebook_rows<decltype(T)::value, D, B>(w, acts, M, m0, n0, n1, out);
  });
}

// A part of the fused GEMV: the (dimension D, code bits in Bs) cases, explicitly instantiated in one
// translation unit each (palette_avx2_*.cpp); true when (w.dim, w.code_bits) is one of its cases
// and it ran.
template <int D, int... Bs>
bool codebook_gemv_part(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1, float* out) {
  if (w.dim != D) return false;
  return ((w.code_bits == Bs && (codebook_gemv_rows<D, Bs>(w, acts, M, n0, n1, out), true)) || ...);
}

#define TLB_CODEBOOK_PARTS(X) X(1, 1, 2, 3, 4) X(2, 3, 4) X(2, 5, 6) X(2, 7, 8) X(2, 9, 10)
#define TLB_DECLARE_CODEBOOK_PART(...)                                                                      \
  extern template bool codebook_gemv_part<__VA_ARGS__>(const CodebookWeights&, const float*, int64_t, int64_t, \
                                                       int64_t, float*);
TLB_CODEBOOK_PARTS(TLB_DECLARE_CODEBOOK_PART)
#undef TLB_DECLARE_CODEBOOK_PART

}  // namespace palette_avx2
}  // namespace torch_lowbit
#endif
