// AVX-512 path of the general VQ table GEMV (gvq.h): tables built 16 entries per register (fp16
// planes converted by vcvtph2ps), then per row 16 fields' entries fetched by one vpgatherdd from the
// chunk's L1-resident tables. Codes of 8 and 16 bits (whole bytes); other widths take the scalar path.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include "common/gvq.h"
#include "common/scratch.h"

// The rest of the file is this ISA's code (the lambdas of gvq_for_chunks too).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")

#define TLB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))

namespace torch_lowbit {
namespace {

struct GvqAvx512Tables;  // thread_scratch tag

// gvq_build_tables_scalar's arithmetic (separate multiplies and adds, coordinate order), 16 entries at once.
TLB_AVX512 void build_tables(const GvqWeights& w, const float* x, int64_t c, int64_t rt, float* lut) {
  const int64_t f0 = c * w.chunk_fields, width = w.chunk_width(c), E = w.entries;
  for (int64_t i = 0; i < width; ++i) {
    const int64_t f = f0 + i;
    const uint16_t* p = reinterpret_cast<const uint16_t*>(w.plane(w.region(rt, f), f));
    const float* xj = x + (f / w.stages) * w.vec;
    float* t = lut + i * E;
    for (int64_t e = 0; e < E; e += 16) {
      __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + e))),
                               _mm512_set1_ps(xj[0]));
      for (int d = 1; d < w.vec; ++d) {
        const __m512 c16 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + d * E + e)));
        v = _mm512_add_ps(v, _mm512_mul_ps(c16, _mm512_set1_ps(xj[d])));
      }
      _mm512_storeu_ps(t + e, v);
    }
  }
}

// 16 fields' codes from i on (fewer at the row's end: masked, nothing read past it) as int32 lanes.
template <int Bits>
TLB_AVX512 inline __m512i load_codes(const uint8_t* row, int64_t i, __mmask16 live) {
  if constexpr (Bits == 8) return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, row + i));
  else return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, reinterpret_cast<const uint16_t*>(row) + i));
}

// Lane r of the result: the sum of s[r]'s 16 lanes (16 rows reduced in 46 shuffles and adds, not 16 x 8).
TLB_AVX512 inline __m512 sums16(const __m512* s) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // quarters 0-1: row 2i's 8 partial sums, 2-3: row 2i + 1's
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter q: row 4i + q's 4 partial sums
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter q: rows 8i + q and 8i + 4 + q, 2 partial sums each
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xDD));
  // lane 4q + k: row q + 4k
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
}

template <int Bits>
TLB_AVX512 void gemv(const GvqWeights& w, const float* x, int64_t M, int64_t c0, int64_t c1, float* acc) {
  const int64_t E = w.entries, per_token = w.chunk_fields * E;
  float* lut = reinterpret_cast<float*>(thread_scratch<GvqAvx512Tables>(M * per_token * sizeof(float)));
  // lane l of a 16-field group reads table l of the group: index = code + l E
  const __m512i lane_base = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(static_cast<int>(E)));
  gvq_for_chunks(
      w, c0, c1,
      [&](int64_t c, int64_t rt) {
        for (int64_t m = 0; m < M; ++m) build_tables(w, x + m * w.K, c, rt, lut + m * per_token);
      },
      [&](int64_t c, int64_t r0, int64_t r1) {
        const int64_t width = w.chunk_width(c), rb = w.chunk_row_bytes(c);
        const uint8_t* block = w.chunk_codes(c);
        if (M == 1) {  // a decode step: 16 rows at a time, their sums reduced together
          for (int64_t n = r0; n < r1; n += 16) {
            const int rows = static_cast<int>(std::min<int64_t>(16, r1 - n));
            __m512 sum[16];
            for (int r = 0; r < 16; ++r) {
              sum[r] = _mm512_setzero_ps();
              if (r >= rows) continue;
              const uint8_t* row = block + (n + r) * rb;
              _mm_prefetch(reinterpret_cast<const char*>(row + 16 * rb), _MM_HINT_T0);
              for (int64_t i = 0; i < width; i += 16) {
                const __mmask16 live = width - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (width - i)) - 1);
                const __m512i idx = _mm512_add_epi32(load_codes<Bits>(row, i, live), lane_base);
                sum[r] = _mm512_add_ps(sum[r], _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, lut + i * E, 4));
              }
            }
            const __mmask16 out = rows == 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
            _mm512_mask_storeu_ps(acc + n, out, _mm512_add_ps(_mm512_maskz_loadu_ps(out, acc + n), sums16(sum)));
          }
          return;
        }
        for (int64_t n = r0; n < r1; ++n) {
          const uint8_t* row = block + n * rb;
          if (n + 1 < r1) _mm_prefetch(reinterpret_cast<const char*>(row + 8 * rb), _MM_HINT_T0);
          __m512 sum[kGvqFusedMaxTokens];
          for (int64_t m = 0; m < M; ++m) sum[m] = _mm512_setzero_ps();
          for (int64_t i = 0; i < width; i += 16) {
            const __mmask16 live = width - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (width - i)) - 1);
            const __m512i idx = _mm512_add_epi32(load_codes<Bits>(row, i, live), lane_base);
            for (int64_t m = 0; m < M; ++m)
              sum[m] = _mm512_add_ps(sum[m], _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx,
                                                                      lut + m * per_token + i * E, 4));
          }
          for (int64_t m = 0; m < M; ++m) acc[m * w.N + n] += _mm512_reduce_add_ps(sum[m]);
        }
      });
}

// The direct kernel (gvq.h, the ablation's "SC"): 16 / vec fields per gather of their entries'
// coordinates, multiplied with x (loaded, or gathered where two stages share a vector).
template <int Bits>
TLB_AVX512 void direct(const GvqWeights& w, const float* entries, const int32_t* field_base, const float* x,
                       int64_t M, int64_t n0, int64_t n1, float* acc) {
  const int vec = w.vec, group = 16 / vec;  // fields per register
  alignas(64) int32_t lane_field[16], lane_coord[16];
  for (int l = 0; l < 16; ++l) lane_field[l] = l / vec, lane_coord[l] = l % vec;
  const __m512i field_of = _mm512_load_si512(lane_field), coord_of = _mm512_load_si512(lane_coord);
  const __m512i vec_v = _mm512_set1_epi32(vec);
  for (int64_t n = n0; n < n1; ++n) {
    const int32_t* base = field_base + (w.tile_rows ? n / w.tile_rows : 0) * w.fields;
    __m512 sum[kGvqFusedMaxTokens];
    for (int64_t m = 0; m < M; ++m) sum[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < w.chunks; ++c) {
      const int64_t rb = w.chunk_row_bytes(c), f0 = c * w.chunk_fields, width = w.chunk_width(c);
      const uint8_t* row = w.chunk_codes(c) + n * rb;
      for (int64_t i = 0; i < width; i += group) {
        const int64_t live_fields = std::min<int64_t>(group, width - i);
        const __mmask16 fields_live = __mmask16((1u << live_fields) - 1);
        const __mmask16 lanes = live_fields == group ? __mmask16(0xFFFF) : __mmask16((1u << (live_fields * vec)) - 1);
        __m512i codes;
        if constexpr (Bits == 8) codes = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(fields_live, row + i));
        else codes = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(fields_live, reinterpret_cast<const uint16_t*>(row) + i));
        const __m512i bases = _mm512_maskz_loadu_epi32(fields_live, base + f0 + i);
        const __m512i at = _mm512_add_epi32(_mm512_permutexvar_epi32(field_of, _mm512_add_epi32(bases, _mm512_mullo_epi32(codes, vec_v))),
                                            coord_of);
        const __m512 e = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, at, entries, 4);
        const int64_t f = f0 + i;
        for (int64_t m = 0; m < M; ++m) {
          const float* xm = x + m * w.K;
          __m512 xv;
          if (w.stages == 1) {
            xv = _mm512_maskz_loadu_ps(lanes, xm + f * vec);
          } else {  // field f + g reads x at ((f + g) / stages) vec + d
            const __m512i xi = _mm512_add_epi32(
                _mm512_mullo_epi32(_mm512_srli_epi32(_mm512_add_epi32(field_of, _mm512_set1_epi32(static_cast<int>(f))), 1), vec_v),
                coord_of);
            xv = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, xi, xm, 4);
          }
          sum[m] = _mm512_fmadd_ps(e, xv, sum[m]);
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) acc[m * w.N + n] += _mm512_reduce_add_ps(sum[m]);
  }
}

}  // namespace

void gvq_direct_avx512(const GvqWeights& w, const float* entries, const int32_t* field_base, const float* x,
                       int64_t M, int64_t n0, int64_t n1, float* acc) {
  if (w.bits == 8) return direct<8>(w, entries, field_base, x, M, n0, n1, acc);
  if (w.bits == 16) return direct<16>(w, entries, field_base, x, M, n0, n1, acc);
  gvq_direct_scalar(w, entries, field_base, x, M, n0, n1, acc);
}

void gvq_gemv_avx512(const GvqWeights& w, const float* x, int64_t M, int64_t c0, int64_t c1, float* acc) {
  if (w.bits == 8) return gemv<8>(w, x, M, c0, c1, acc);
  if (w.bits == 16) return gemv<16>(w, x, M, c0, c1, acc);
  gvq_gemv_scalar(w, x, M, c0, c1, acc);
}

}  // namespace torch_lowbit

#pragma GCC pop_options
#endif
