// AVX2 paths of the palette kernels (palette.h): the plan of the AVX-512 kernels (palette_avx512.cpp)
// in 8-lane halves, for the CPUs without AVX-512 (and AVX-512 without VBMI). Decoding is the scalar
// path's arithmetic (one table read, one multiply by the row scale), so the dequantize ops are bit
// for bit the scalar ones; the fused GEMVs differ from scalar only in the order of the fp32 sums.
//
// Codebook formats: code vector v (codes 16 v .. 16 v + 15) is two aligned 8-word loads (streams
// 0-7 and 8-15) cut with a uniform shift. Tables of up to 32 entries per coordinate stay in
// registers: vpermps reads index bits 2..0 and blends on bits 3 and 4 pick among 8-entry quarters;
// larger tables are gathered (vgatherdps).
// TCQ: palette_avx2_tcq.h (its GEMV compiled here for AVX2 and again with vpdpbusd for AVX-VNNI).
#if defined(TORCH_LOWBIT_X86)
#define TLB_TCQ_KERNEL TLB_AVX2
#include "x86/palette_avx2_tcq.h"

namespace torch_lowbit {
namespace palette_avx2 {

template <int D, int LK>
TLB_AVX2 void codebook_decode_rows(const CodebookWeights& w, int64_t n0, int64_t n1, float* dst) {
  const int bits = w.code_bits;
  const int64_t entries = int64_t{1} << bits, codes = w.K / D, vectors = (codes + 15) / 16;
  PlaneTable tab[D];
  for (int c = 0; c < D; ++c) tab[c] = plane_table(w.planes + c * entries, entries);
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* words = w.words + n * w.row_words;
    const __m256 scale = _mm256_set1_ps(static_cast<float>(w.scales[n]));
    float* row = dst + (n - n0) * w.K;
    for (int64_t v = 0; v < vectors; ++v)
      for (int h = 0; h < 2; ++h) {
        const int64_t j = 16 * v + 8 * h;
        if (j >= codes) break;
        const __m256i code = stream_codes(words, v, h, bits);
        const __m256 v0 = _mm256_mul_ps(lookup<LK>(tab[0], code), scale);
        if constexpr (D == 1) {
          if (codes - j >= 8) _mm256_storeu_ps(row + j, v0);
          else _mm256_maskstore_ps(row + j, first_lanes(codes - j), v0);
        } else {
          const __m256 v1 = _mm256_mul_ps(lookup<LK>(tab[1], code), scale);
          const __m256 lo = _mm256_unpacklo_ps(v0, v1), hi = _mm256_unpackhi_ps(v0, v1);
          const __m256 first = _mm256_permute2f128_ps(lo, hi, 0x20), second = _mm256_permute2f128_ps(lo, hi, 0x31);
          const int64_t left = 2 * (codes - j);  // weights of the row from 2 j on
          if (left >= 16) {
            _mm256_storeu_ps(row + 2 * j, first);
            _mm256_storeu_ps(row + 2 * j + 8, second);
          } else {
            _mm256_maskstore_ps(row + 2 * j, first_lanes(left), first);
            if (left > 8) _mm256_maskstore_ps(row + 2 * j + 8, first_lanes(left - 8), second);
          }
        }
      }
  }
}

template <int D>
void codebook_decode_lookup(const CodebookWeights& w, int64_t n0, int64_t n1, float* dst) {
  switch (lookup_kind(w.code_bits)) {
    case kPerm8: return codebook_decode_rows<D, kPerm8>(w, n0, n1, dst);
    case kPerm16: return codebook_decode_rows<D, kPerm16>(w, n0, n1, dst);
    case kPerm32: return codebook_decode_rows<D, kPerm32>(w, n0, n1, dst);
    default: return codebook_decode_rows<D, kGather>(w, n0, n1, dst);
  }
}

}  // namespace palette_avx2

using namespace palette_avx2;

void codebook_gemv_avx2(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1, float* out) {
#define TLB_RUN_CODEBOOK_PART(...) \
  if (codebook_gemv_part<__VA_ARGS__>(w, acts, M, n0, n1, out)) return;
  TLB_CODEBOOK_PARTS(TLB_RUN_CODEBOOK_PART)
#undef TLB_RUN_CODEBOOK_PART
  codebook_gemv_scalar(w, acts, M, n0, n1, out);  // codes the vector paths do not cover
}

void codebook_decode_avx2(const CodebookWeights& w, int64_t n0, int64_t n1, float* dst) {
  if (w.dim == 1) codebook_decode_lookup<1>(w, n0, n1, dst);
  else codebook_decode_lookup<2>(w, n0, n1, dst);
}

void tcq_gemv_avx2(const TcqWeights& w, const float* x, int64_t M, int64_t b0, int64_t b1, float* out) {
  tcq_gemv_kernel(w, x, M, b0, b1, out);
}

template <bool kMad>
TLB_AVX2 void tcq_decode_bands(const TcqWeights& w, int64_t b0, int64_t b1, float* dst) {
  const TcqContext ctx = tcq_context(w);
  const int64_t tiles = w.K / kTcqTile;
  for (int64_t b = b0; b < b1; ++b) {
    float* band = dst + (b - b0) * kTcqTile * w.K;
    const int32_t* first_seq = reinterpret_cast<const int32_t*>(w.words + b * tiles * ctx.count);
    for (int r = 0; r < kTcqTile; ++r) {
      const TcqRowLanes L = row_lanes(ctx, r, w.table_bits);
      const float row_scale = static_cast<float>(w.scales[b * kTcqTile + r]);
      // 1mad: integer values times scale / 128, the same single rounding as value / 128 times scale
      const __m256 scale = _mm256_set1_ps(kMad ? row_scale * kTcqMadUnit : row_scale);
      const int32_t* seq = first_seq;
      for (int64_t t = 0; t < tiles; ++t, seq += ctx.count) {
        __m256 c0, c1;
        tcq_row<kMad>(seq, L, ctx.table, ctx.hash_shift, c0, c1);
        _mm256_storeu_ps(band + r * w.K + t * kTcqTile, _mm256_mul_ps(c0, scale));
        _mm256_storeu_ps(band + r * w.K + t * kTcqTile + 8, _mm256_mul_ps(c1, scale));
      }
    }
  }
}

void tcq_decode_avx2(const TcqWeights& w, int64_t b0, int64_t b1, float* dst) {
  if (w.table_bits == kTcqMadTableBits) return tcq_decode_bands<true>(w, b0, b1, dst);
  tcq_decode_bands<false>(w, b0, b1, dst);
}

}  // namespace torch_lowbit
#endif

