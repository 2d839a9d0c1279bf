// The AVX-512 VNNI tile kernel of lut_i8's integer sub-scales (K-quants, layout kquant_i8_n16; the
// math is csrc/common/lut_i8.h's "integer sub-scales"). Included by lut_i8_avx512vnni.cpp after
// lut_i8_avx512_kernel.h, whose decode_quads it shares.
//
// Per (tile, block) the codes decode once (identity table: no lookup) and every token of the run
// takes two vpdpbusd chains, one per 16 features: a sub-block of 16 is one chain, one of 32 both.
// The sub-blocks' sums are weighted by the rows' sub-scales with vpmulld (16 rows per register) and
// added in int32, so a block costs one convert and one fma per token whatever its sub-blocks; the
// super-block's d and dmin are applied once per 256 features.
#pragma once

// GCC 12's false (maybe-)uninitialized reports on its own _mm512_undefined_* (see lut_i8_avx512_kernel.h)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace torch_lowbit {
namespace {

// The 16 rows' sub-scales (signed) or sub-mins (unsigned) of sub-block j of tile t as int32 lanes.
TLB_KERNEL inline __m512i sub_params(const int8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
TLB_KERNEL inline __m512i sub_params(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// NT tiles x MT tokens (t .. t+NT-1, m0 .. m0+MT-1); SUB features per sub-scale (16 or 32); MINS: sub_mins.
template <int B, int SUB, bool MINS, int NT, int MT>
TLB_KERNEL void sub_scaled_tiles(const LutI8Weights& w, const Q8Acts& a, int64_t t, int64_t m0, float* out,
                                 int64_t ldo) {
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  constexpr int kSubs = 32 / SUB;  // sub-blocks per block
  __m512 acc[NT][MT];
  __mmask16 row_mask[NT];
  for (int n = 0; n < NT; ++n) {
    const int64_t rows = std::min(kI8TileRows, w.N - (t + n) * kI8TileRows);
    row_mask[n] = static_cast<__mmask16>((1u << rows) - 1u);
    const __m512 start = w.bias ? _mm512_maskz_loadu_ps(row_mask[n], w.bias + (t + n) * kI8TileRows) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) acc[n][m] = start;
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512 gacc[NT][MT], macc[NT][MT];
    for (int n = 0; n < NT; ++n)
      for (int m = 0; m < MT; ++m) gacc[n][m] = macc[n][m] = _mm512_setzero_ps();
    for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
      const int64_t b = g * blocks_per_group + bb;
      __m512i quad[NT][8], scale[NT][kSubs], low[NT][kSubs];
      for (int n = 0; n < NT; ++n) {
        const uint8_t* p = lut_i8_block(w, t + n, b);
        for (int c = 0; c < B; ++c) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + 64 * c), _MM_HINT_T0);
        decode_quads<B>(p, quad[n]);
        for (int h = 0; h < kSubs; ++h) {
          const int64_t s = lut_i8_sub_index(w, t + n, b * kSubs + h);
          scale[n][h] = sub_params(w.sub_scales + s);
          if constexpr (MINS) low[n][h] = sub_params(w.sub_mins + s);
        }
      }
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        const int64_t token = m0 + m;
        const int8_t* xq = a.q + token * a.K + b * 32;
        int32_t xsum[kSubs];  // the sub-blocks' sums of q
        for (int h = 0; h < kSubs; ++h) xsum[h] = kSubs == 1 ? a.sum[token * kb_count + b] : a.half_sum[token * 2 * kb_count + 2 * b + h];
        const __m512 xd = _mm512_set1_ps(a.d[token * kb_count + b]);
        for (int n = 0; n < NT; ++n) {
          __m512i half[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // features 0-15, 16-31
          for (int qd = 0; qd < 4; ++qd) {
            half[0] = _mm512_dpbusd_epi32(half[0], quad[n][qd], _mm512_set1_epi32(load_act4(xq + 4 * qd)));
            half[1] = _mm512_dpbusd_epi32(half[1], quad[n][qd + 4], _mm512_set1_epi32(load_act4(xq + 16 + 4 * qd)));
          }
          __m512i isum, msum;
          if constexpr (kSubs == 1) {
            isum = _mm512_sub_epi32(_mm512_add_epi32(half[0], half[1]), _mm512_set1_epi32(w.offset * xsum[0]));
            isum = _mm512_mullo_epi32(isum, scale[n][0]);
            if constexpr (MINS) msum = _mm512_mullo_epi32(low[n][0], _mm512_set1_epi32(xsum[0]));
          } else {
            isum = _mm512_add_epi32(
                _mm512_mullo_epi32(_mm512_sub_epi32(half[0], _mm512_set1_epi32(w.offset * xsum[0])), scale[n][0]),
                _mm512_mullo_epi32(_mm512_sub_epi32(half[1], _mm512_set1_epi32(w.offset * xsum[1])), scale[n][1]));
            if constexpr (MINS)
              msum = _mm512_add_epi32(_mm512_mullo_epi32(low[n][0], _mm512_set1_epi32(xsum[0])),
                                      _mm512_mullo_epi32(low[n][1], _mm512_set1_epi32(xsum[1])));
          }
          gacc[n][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), xd, gacc[n][m]);
          if constexpr (MINS) macc[n][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), xd, macc[n][m]);
        }
      }
    }
    for (int n = 0; n < NT; ++n) {
      const int64_t pidx = ((t + n) * groups + g) * kI8TileRows;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + pidx)));
      __m512 neg_dmin = _mm512_setzero_ps();
      if constexpr (MINS) neg_dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + pidx)));
      for (int m = 0; m < MT; ++m) {
        acc[n][m] = _mm512_fmadd_ps(gacc[n][m], d, acc[n][m]);
        if constexpr (MINS) acc[n][m] = _mm512_fmadd_ps(neg_dmin, macc[n][m], acc[n][m]);
      }
    }
  }
  for (int n = 0; n < NT; ++n)
    for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(out + (m0 + m) * ldo + (t + n) * kI8TileRows, row_mask[n], acc[n][m]);
}

template <int B, int SUB, bool MINS>
TLB_KERNEL void sub_scaled_range(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  int64_t t = t0;
  if (a.M == 1)  // decode: two weight streams in flight per thread
    for (; t + 2 <= t1; t += 2) sub_scaled_tiles<B, SUB, MINS, 2, 1>(w, a, t, 0, out, ldo);
  for (; t < t1; ++t)
    for_token_blocks<4>(a.M, [&](auto mt, int64_t m0) TLB_KERNEL {
      sub_scaled_tiles<B, SUB, MINS, 1, decltype(mt)::value>(w, a, t, m0, out, ldo);
    });
}

}  // namespace
}  // namespace torch_lowbit

#pragma GCC diagnostic pop
