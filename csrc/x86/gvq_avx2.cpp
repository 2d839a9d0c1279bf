// AVX2 path of the general VQ table GEMV (gvq.h): tables built 8 entries per register (F16C), then
// per row 8 fields' entries fetched by one vpgatherdd from the chunk's L1-resident tables. Codes of 8
// and 16 bits; other widths take the scalar path.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include "common/gvq.h"
#include "common/scratch.h"
#include "x86/sums_avx2.h"

// The rest of the file is this ISA's code (the lambdas of gvq_for_chunks too).
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")

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
  gvq_for_chunks(
      w, c0, c1,
      [&](int64_t c, int64_t rt) {
        for (int64_t m = 0; m < M; ++m) build_tables(w, x + m * w.K, c, rt, lut + m * per_token);
      },
      [&](int64_t c, int64_t r0, int64_t r1) {
        const int64_t width = w.chunk_width(c), rb = w.chunk_row_bytes(c), whole = width / 8 * 8;
        const uint8_t* block = w.chunk_codes(c);
        if (M == 1) {  // a decode step: 8 rows at a time, their sums reduced together (sums8)
          int64_t n = r0;
          for (; n + 8 <= r1; n += 8) {
            __m256 sum[8];
            float tail[8] = {};
            for (int r = 0; r < 8; ++r) {
              const uint8_t* row = block + (n + r) * rb;
              _mm_prefetch(reinterpret_cast<const char*>(row + 16 * rb), _MM_HINT_T0);
              sum[r] = _mm256_setzero_ps();
              for (int64_t i = 0; i < whole; i += 8)
                sum[r] = _mm256_add_ps(sum[r], _mm256_i32gather_ps(lut + i * E, _mm256_add_epi32(load_codes<Bits>(row, i), lane_base), 4));
              for (int64_t i = whole; i < width; ++i) tail[r] += lut[i * E + gvq_field(row, i, Bits, rb)];
            }
            const __m256 total = _mm256_add_ps(sums8(sum), _mm256_loadu_ps(tail));
            _mm256_storeu_ps(acc + n, _mm256_add_ps(_mm256_loadu_ps(acc + n), total));
          }
          for (; n < r1; ++n) {
            const uint8_t* row = block + n * rb;
            __m256 sum = _mm256_setzero_ps();
            for (int64_t i = 0; i < whole; i += 8)
              sum = _mm256_add_ps(sum, _mm256_i32gather_ps(lut + i * E, _mm256_add_epi32(load_codes<Bits>(row, i), lane_base), 4));
            float s = hsum(sum);
            for (int64_t i = whole; i < width; ++i) s += lut[i * E + gvq_field(row, i, Bits, rb)];
            acc[n] += s;
          }
          return;
        }
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
      });
}

// The direct kernel (gvq.h, the ablation's "SC"): 8 / vec fields per gather of their entries'
// coordinates, multiplied with x (loaded, or gathered where two stages share a vector).
template <int Bits>
TLB_AVX2 void direct(const GvqWeights& w, const float* entries, const int32_t* field_base, const float* x,
                     int64_t M, int64_t n0, int64_t n1, float* acc) {
  const int vec = w.vec, group = 8 / vec;  // fields per register
  alignas(32) int32_t lane_field[8], lane_coord[8];
  for (int l = 0; l < 8; ++l) lane_field[l] = l / vec, lane_coord[l] = l % vec;
  const __m256i field_of = _mm256_load_si256(reinterpret_cast<const __m256i*>(lane_field));
  const __m256i coord_of = _mm256_load_si256(reinterpret_cast<const __m256i*>(lane_coord));
  alignas(32) int32_t at[8];
  alignas(32) float xs[8];
  for (int64_t n = n0; n < n1; ++n) {
    const int32_t* base = field_base + (w.tile_rows ? n / w.tile_rows : 0) * w.fields;
    __m256 sum[kGvqFusedMaxTokens];
    float tail[kGvqFusedMaxTokens] = {};
    for (int64_t m = 0; m < M; ++m) sum[m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < w.chunks; ++c) {
      const int64_t rb = w.chunk_row_bytes(c), f0 = c * w.chunk_fields, width = w.chunk_width(c);
      const uint8_t* row = w.chunk_codes(c) + n * rb;
      const int64_t whole = width / group * group;
      for (int64_t i = 0; i < whole; i += group) {
        for (int g = 0; g < group; ++g)  // where each field's entry starts
          at[g] = base[f0 + i + g] + static_cast<int32_t>(gvq_field(row, i + g, Bits, rb)) * vec;
        const __m256i starts = _mm256_i32gather_epi32(at, field_of, 4);
        const __m256 e = _mm256_i32gather_ps(entries, _mm256_add_epi32(starts, coord_of), 4);
        const int64_t f = f0 + i;
        for (int64_t m = 0; m < M; ++m) {
          const float* xm = x + m * w.K;
          __m256 xv;
          if (w.stages == 1) {
            xv = _mm256_loadu_ps(xm + f * vec);
          } else {
            for (int l = 0; l < 8; ++l) xs[l] = xm[((f + lane_field[l]) / 2) * vec + lane_coord[l]];
            xv = _mm256_load_ps(xs);
          }
          sum[m] = _mm256_fmadd_ps(e, xv, sum[m]);
        }
      }
      for (int64_t i = whole; i < width; ++i) {  // a ragged last chunk
        const int64_t f = f0 + i;
        const float* ent = entries + base[f] + gvq_field(row, i, Bits, rb) * vec;
        for (int64_t m = 0; m < M; ++m)
          for (int d = 0; d < vec; ++d) tail[m] += ent[d] * x[m * w.K + (f / w.stages) * vec + d];
      }
    }
    for (int64_t m = 0; m < M; ++m) acc[m * w.N + n] += hsum(sum[m]) + tail[m];
  }
}

}  // namespace

void gvq_direct_avx2(const GvqWeights& w, const float* entries, const int32_t* field_base, const float* x,
                     int64_t M, int64_t n0, int64_t n1, float* acc) {
  if (w.bits == 8) return direct<8>(w, entries, field_base, x, M, n0, n1, acc);
  if (w.bits == 16) return direct<16>(w, entries, field_base, x, M, n0, n1, acc);
  gvq_direct_scalar(w, entries, field_base, x, M, n0, n1, acc);
}

void gvq_gemv_avx2(const GvqWeights& w, const float* x, int64_t M, int64_t c0, int64_t c1, float* acc) {
  if (w.bits == 8) return gemv<8>(w, x, M, c0, c1, acc);
  if (w.bits == 16) return gemv<16>(w, x, M, c0, c1, acc);
  gvq_gemv_scalar(w, x, M, c0, c1, acc);
}

}  // namespace torch_lowbit

#pragma GCC pop_options
#endif
