// The AVX2 tile kernel of lut_i8's integer sub-scales (K-quants, layout kquant_i8_n16; the math is
// csrc/common/lut_i8.h's "integer sub-scales"). Included by lut_i8_avx2.cpp after lut_i8_avx2_kernel.h,
// whose decode_quads it shares.
//
// A 16-row tile is two 8-row halves. Per (tile, block) both halves decode once (identity table: no
// lookup) and every token of the run takes, per sub-block, vpmaddubsw pairs summed in int16 over as
// many quads as cannot overflow (kChainQuads), then one vpmaddwd against the rows' sub-scales (each in
// both int16 halves of its row's lane): the sub-scale multiply is the int16 -> int32 widening the
// plain kernels pay anyway. Offsets (q3_k, q6_k) and mins take one vpmulld per sub-block.
#pragma once

namespace torch_lowbit {
namespace {

// Quads whose vpmaddubsw pairs one int16 lane can sum: k * 2 * (2^B - 1) * 127 < 2^15.
template <int B>
constexpr int kChainQuads = B <= 4 ? 8 : B == 5 ? 4 : 2;

// The 8 rows' int8 sub-scales (signed) or uint8 sub-mins as int32 lanes.
TLB_KERNEL inline __m256i sub_params8(const int8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
TLB_KERNEL inline __m256i sub_params8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// s in both int16 halves of each int32 lane: vpmaddwd then gives s * (the lane's two int16 sums).
TLB_KERNEL inline __m256i both_halves(__m256i s32) {
  return _mm256_or_si256(_mm256_and_si256(s32, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(s32, 16));
}

// One tile x MT tokens (m0 ..); SUB features per sub-scale (16 or 32); MINS: sub_mins.
template <int B, int SUB, bool MINS, int MT>
TLB_KERNEL void sub_scaled_tile(const LutI8Weights& w, const Q8Acts& a, int64_t t, int64_t m0, float* out, int64_t ldo) {
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  constexpr int kSubs = 32 / SUB, kSubQuads = SUB / 4, kChain = std::min(kSubQuads, kChainQuads<B>);
  const int64_t row0 = t * kI8TileRows, rows = std::min(kI8TileRows, w.N - row0);
  __m256 acc[2][MT];
  for (int hf = 0; hf < 2; ++hf) {
    alignas(32) float start[8] = {0};
    for (int r = 0; r < 8 && w.bias; ++r)
      if (8 * hf + r < rows) start[r] = w.bias[row0 + 8 * hf + r];
    for (int m = 0; m < MT; ++m) acc[hf][m] = _mm256_load_ps(start);
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m256 gacc[2][MT], macc[2][MT];
    for (int hf = 0; hf < 2; ++hf)
      for (int m = 0; m < MT; ++m) gacc[hf][m] = macc[hf][m] = _mm256_setzero_ps();
    for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
      const int64_t b = g * blocks_per_group + bb;
      const uint8_t* p = lut_i8_block(w, t, b);
      for (int c = 0; c < B; ++c) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + 64 * c), _MM_HINT_T0);
      alignas(32) __m256i quad[2][8];
      __m256i scale[2][kSubs], scale16[2][kSubs], low[2][kSubs];
      for (int hf = 0; hf < 2; ++hf) {
        decode_quads<B>(p + 32 * hf, quad[hf]);
        for (int h = 0; h < kSubs; ++h) {
          const int64_t s = lut_i8_sub_index(w, t, b * kSubs + h) + 8 * hf;
          scale[hf][h] = sub_params8(w.sub_scales + s);
          scale16[hf][h] = both_halves(scale[hf][h]);
          if constexpr (MINS) low[hf][h] = sub_params8(w.sub_mins + s);
        }
      }
      for (int m = 0; m < MT; ++m) {
        const int64_t token = m0 + m;
        const int8_t* xq = a.q + token * a.K + b * 32;
        int32_t xsum[kSubs];  // the sub-blocks' sums of q
        for (int h = 0; h < kSubs; ++h) xsum[h] = kSubs == 1 ? a.sum[token * kb_count + b] : a.half_sum[token * 2 * kb_count + 2 * b + h];
        const __m256 xd = _mm256_set1_ps(a.d[token * kb_count + b]);
        for (int hf = 0; hf < 2; ++hf) {
          __m256i isum = _mm256_setzero_si256(), msum = _mm256_setzero_si256();
          for (int h = 0; h < kSubs; ++h) {
            for (int c0 = h * kSubQuads; c0 < (h + 1) * kSubQuads; c0 += kChain) {
              __m256i chain = _mm256_setzero_si256();  // int16 sums of vpmaddubsw pairs
              for (int qd = c0; qd < c0 + kChain; ++qd)
                chain = _mm256_add_epi16(chain, _mm256_maddubs_epi16(quad[hf][qd], _mm256_set1_epi32(load_act4(xq + 4 * qd))));
              isum = _mm256_add_epi32(isum, _mm256_madd_epi16(chain, scale16[hf][h]));
            }
            if (w.offset) isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(scale[hf][h], _mm256_set1_epi32(w.offset * xsum[h])));
            if constexpr (MINS) msum = _mm256_add_epi32(msum, _mm256_mullo_epi32(low[hf][h], _mm256_set1_epi32(xsum[h])));
          }
          gacc[hf][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), xd, gacc[hf][m]);
          if constexpr (MINS) macc[hf][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), xd, macc[hf][m]);
        }
      }
    }
    for (int hf = 0; hf < 2; ++hf) {
      const __m256 d = half_params(w.scales, groups, t, g, hf);
      const __m256 neg_dmin = MINS ? half_params(w.mins, groups, t, g, hf) : _mm256_setzero_ps();
      for (int m = 0; m < MT; ++m) {
        acc[hf][m] = _mm256_fmadd_ps(gacc[hf][m], d, acc[hf][m]);
        if constexpr (MINS) acc[hf][m] = _mm256_fmadd_ps(neg_dmin, macc[hf][m], acc[hf][m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    alignas(32) float res[kI8TileRows];
    _mm256_store_ps(res, acc[0][m]);
    _mm256_store_ps(res + 8, acc[1][m]);
    std::copy(res, res + rows, out + (m0 + m) * ldo + row0);
  }
}

template <int B, int SUB, bool MINS>
TLB_KERNEL void sub_scaled_range(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  for (int64_t t = t0; t < t1; ++t)
    for_token_blocks<2>(a.M, [&](auto mt, int64_t m0) TLB_KERNEL {
      sub_scaled_tile<B, SUB, MINS, decltype(mt)::value>(w, a, t, m0, out, ldo);
    });
}

}  // namespace
}  // namespace torch_lowbit
