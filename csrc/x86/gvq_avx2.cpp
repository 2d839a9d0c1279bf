// AVX2 path of the general VQ table GEMV (gvq.h): tables built 8 entries per register (F16C), then
// per row 8 fields' entries fetched by one vpgatherdd from the chunk's L1-resident tables. Codes of 8
// and 16 bits; other widths take the scalar path.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include "common/gvq.h"
#include "common/scratch.h"

#define TLB_AVX2 __attribute__((target("avx2,f16c,fma")))

namespace torch_lowbit {
namespace {

struct GvqAvx2Tables;  // thread_scratch tag

// gvq_build_tables_scalar's arithmetic, 8 entries at once.
TLB_AVX2 void build_tables(const GvqWeights& w, const float* x, int64_t c, int64_t rt, float* lut) {
  const int64_t f0 = c * w.chunk_fields, width = w.chunk_width(c), E = w.entries;
  for (int64_t i = 0; i < width; ++i) {
    const int64_t f = f0 + i;
    const uint16_t* p = reinterpret_cast<const uint16_t*>(w.plane(w.region(rt, f), f));
    const float* xj = x + (f / w.stages) * w.vec;
    float* t = lut + i * E;
    for (int64_t e = 0; e < E; e += 8) {
      __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + e))),
                               _mm256_set1_ps(xj[0]));
      for (int d = 1; d < w.vec; ++d) {
        const __m256 c8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + d * E + e)));
        v = _mm256_add_ps(v, _mm256_mul_ps(c8, _mm256_set1_ps(xj[d])));
      }
      _mm256_storeu_ps(t + e, v);
    }
  }
}

TLB_AVX2 inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

template <int Bits>
TLB_AVX2 inline __m256i load_codes(const uint8_t* row, int64_t i) {
  if constexpr (Bits == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
  else return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
}

template <int Bits>
TLB_AVX2 void gemv(const GvqWeights& w, const float* x, int64_t M, int64_t c0, int64_t c1, float* acc) {
  const int64_t E = w.entries, per_token = w.chunk_fields * E;
  float* lut = reinterpret_cast<float*>(thread_scratch<GvqAvx2Tables>(M * per_token * sizeof(float)));
  const __m256i lane_base = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                               _mm256_set1_epi32(static_cast<int>(E)));
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t width = w.chunk_width(c), rb = w.chunk_row_bytes(c), whole = width / 8 * 8;
    const uint8_t* block = w.chunk_codes(c);
    for (int64_t rt = 0; rt < w.row_tiles(); ++rt) {
      const int64_t r0 = w.tile_rows ? rt * w.tile_rows : 0, r1 = w.tile_rows ? std::min(w.N, r0 + w.tile_rows) : w.N;
      for (int64_t m = 0; m < M; ++m) build_tables(w, x + m * w.K, c, rt, lut + m * per_token);
      for (int64_t n = r0; n < r1; ++n) {
        const uint8_t* row = block + n * rb;
        if (n + 1 < r1) _mm_prefetch(reinterpret_cast<const char*>(row + 8 * rb), _MM_HINT_T0);
        __m256 sum[kGvqFusedMaxTokens];
        for (int64_t m = 0; m < M; ++m) sum[m] = _mm256_setzero_ps();
        for (int64_t i = 0; i < whole; i += 8) {  // whole groups of 8 fields: never past the row
          const __m256i idx = _mm256_add_epi32(load_codes<Bits>(row, i), lane_base);
          for (int64_t m = 0; m < M; ++m)
            sum[m] = _mm256_add_ps(sum[m], _mm256_i32gather_ps(lut + m * per_token + i * E, idx, 4));
        }
        for (int64_t m = 0; m < M; ++m) {
          float s = hsum(sum[m]);
          for (int64_t i = whole; i < width; ++i) s += lut[m * per_token + i * E + gvq_field(row, i, Bits, rb)];
          acc[m * w.N + n] += s;
        }
      }
    }
  }
}

}  // namespace

void gvq_gemv_avx2(const GvqWeights& w, const float* x, int64_t M, int64_t c0, int64_t c1, float* acc) {
  if (w.bits == 8) return gemv<8>(w, x, M, c0, c1, acc);
  if (w.bits == 16) return gemv<16>(w, x, M, c0, c1, acc);
  gvq_gemv_scalar(w, x, M, c0, c1, acc);
}

}  // namespace torch_lowbit
#endif
