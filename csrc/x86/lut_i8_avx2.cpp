// AVX2 lut x int8 kernel over the same lut{b}_i8_n16 layouts. Without vpdpbusd, products go through
// vpmaddubsw (unsigned x signed bytes -> saturating int16 pairs): to stay clear of saturation it
// multiplies |t| by sign(t)*x, both within +-127 (the sign trick), then vpmaddwd sums 4 products
// into each int32 lane. That yields sum t*x, which equals the other paths' sum u*x - offset*sum x
// exactly, so the float epilogue (same ops, same order) gives bit-identical results. (q8_0's byte 0,
// t = -128, which ggml never writes, still works: vpsignb leaves 0x80, read as the unsigned 128.) A 16-row tile
// is two 8-lane halves (bytes 0..31 and 32..63 of each 64-byte chunk). Group codebooks (gcb): a
// 32-bit gather per block fetches each row's 4-entry codebook (gcb3: two, entries 0-3 and 4-7) into
// the row's own lane, so vpshufb looks codes up within the lane (blend on bit 2 for gcb3).
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <algorithm>

#include "common/lut_i8.h"
#include "common/token_blocks.h"

#define TLB_AVX2_I8 __attribute__((target("avx2,fma,f16c")))

namespace torch_lowbit {
namespace {

// 4 products per int32 lane: sum over the lane's bytes of t * x (t signed table bytes).
TLB_AVX2_I8 inline __m256i dot4(__m256i t, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(t, t), _mm256_sign_epi8(x, t));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// The 8 quads of one half tile (p already offset by 32 * half), as lut_i8.h lays them out.
template <int W>
TLB_AVX2_I8 inline void plane_quads(const uint8_t* p, __m256i q[8]) {
  const __m256i mask = _mm256_set1_epi8((1 << W) - 1);
  for (int c = 0; c < W; ++c) {
    const __m256i chunk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c));
    for (int f = 0; f < 8 / W; ++f) q[f * W + c] = _mm256_and_si256(_mm256_srli_epi16(chunk, W * f), mask);
  }
}

template <int B>
TLB_AVX2_I8 inline void decode_quads(const uint8_t* p, __m256i q[8]) {
  if constexpr (B == 8) {  // chunk qd is quad qd: the code bytes as they are
    for (int qd = 0; qd < 8; ++qd) q[qd] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * qd));
  } else if constexpr (B == 3) {
    plane_quads<2>(p, q);
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128)), bit2 = _mm256_set1_epi8(4);
    for (int f = 0; f < 8; ++f) {
      const __m256i moved = f < 2 ? _mm256_slli_epi16(hi, 2 - f) : _mm256_srli_epi16(hi, f - 2);
      q[f] = _mm256_or_si256(q[f], _mm256_and_si256(moved, bit2));
    }
  } else {
    plane_quads<B>(p, q);
  }
}

// Signed table bytes of the 8 quads of one half tile from the <= 16-entry table (or gcb's per-row
// codebooks); sub: that half's 8 sub-group bytes (gcb) or nullptr.
template <int B>
TLB_AVX2_I8 inline void lookup_table_quads(__m256i q[8], const int8_t* signed_table, const uint8_t* sub) {
  if (!sub) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(signed_table)));
    for (int qd = 0; qd < 8; ++qd) q[qd] = _mm256_shuffle_epi8(table, q[qd]);
    return;
  }
  const __m256i cb = _mm256_srli_epi32(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub))), 4);  // codebook per row
  const int* words = reinterpret_cast<const int*>(signed_table);  // 4 entries per word
  const __m256i lane_base = _mm256_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0);
  if constexpr (B == 2) {
    const __m256i rows = _mm256_i32gather_epi32(words, cb, 4);
    for (int qd = 0; qd < 8; ++qd) q[qd] = _mm256_shuffle_epi8(rows, _mm256_or_si256(q[qd], lane_base));
  } else {
    const __m256i lo = _mm256_i32gather_epi32(words, _mm256_slli_epi32(cb, 1), 4);
    const __m256i hi = _mm256_i32gather_epi32(words + 1, _mm256_slli_epi32(cb, 1), 4);
    for (int qd = 0; qd < 8; ++qd) {
      const __m256i idx = _mm256_or_si256(_mm256_and_si256(q[qd], _mm256_set1_epi8(3)), lane_base);
      q[qd] = _mm256_blendv_epi8(_mm256_shuffle_epi8(lo, idx), _mm256_shuffle_epi8(hi, idx), _mm256_slli_epi16(q[qd], 5));
    }
  }
}

// Signed weight bytes of the 8 quads of one half tile (q8_0: the bytes themselves, flipped).
template <int B>
TLB_AVX2_I8 inline void lookup_quads(__m256i q[8], const int8_t* signed_table, const uint8_t* sub) {
  if constexpr (B == 8) {  // q8_0 (table code - 128, checked by the op): the signed value is the byte ^ 0x80
    for (int qd = 0; qd < 8; ++qd) q[qd] = _mm256_xor_si256(q[qd], _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    lookup_table_quads<B>(q, signed_table, sub);
  }
}

template <int B, int MT>
TLB_AVX2_I8 void tile_tokens(const LutI8Weights& w, const Q8Acts& a, int64_t t, int64_t m0, float* out,
                             int64_t ldo) {
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  constexpr int kTableBytes = 128;  // the most a <= 4-bit lookup reads (gcb3: 16 codebooks x 8); 8-bit reads none
  int8_t signed_table[kTableBytes];
  if constexpr (B != 8)
    for (int i = 0; i < kTableBytes; ++i) signed_table[i] = static_cast<int8_t>(w.utable[i] - w.offset);
  const uint8_t* tile = w.qweight + t * kb_count * (64 * B);
  const int64_t rows = std::min(kI8TileRows, w.N - t * kI8TileRows);
  for (int half = 0; half < 2; ++half) {
    const int64_t n_here = std::min<int64_t>(8, rows - 8 * half);
    float start[8] = {0};
    for (int64_t r = 0; r < n_here && w.bias; ++r) start[r] = w.bias[t * kI8TileRows + 8 * half + r];
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_loadu_ps(start);
    for (int64_t g = 0; g < groups; ++g) {
      __m256 gacc[MT];
      for (int m = 0; m < MT; ++m) gacc[m] = _mm256_setzero_ps();
      for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
        const int64_t b = g * blocks_per_group + bb;
        __m256i quad[8];
        decode_quads<B>(tile + b * (64 * B) + 32 * half, quad);
        const uint8_t* sub = w.sub_groups ? w.sub_groups + (t * kb_count + b) * kI8TileRows + 8 * half : nullptr;
        lookup_quads<B>(quad, signed_table, sub);
        const __m256 steps = sub ? _mm256_cvtepi32_ps(_mm256_and_si256(
                                       _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub))),
                                       _mm256_set1_epi32(15)))
                                 : _mm256_setzero_ps();
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = a.q + (m0 + m) * a.K + b * 32;
          __m256i isum = _mm256_setzero_si256();
          for (int qd = 0; qd < 8; ++qd)
            isum = _mm256_add_epi32(isum, dot4(quad[qd], _mm256_set1_epi32(load_act4(xq + 4 * qd))));
          const __m256 xd = _mm256_set1_ps(a.d[(m0 + m) * kb_count + b]);
          gacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sub ? _mm256_mul_ps(steps, xd) : xd, gacc[m]);
        }
      }
      const int64_t pidx = (t * groups + g) * kI8TileRows + 8 * half;
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales + pidx)));
      const __m256 mn = w.mins ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mins + pidx)))
                               : _mm256_setzero_ps();
      for (int m = 0; m < MT; ++m) {
        acc[m] = _mm256_fmadd_ps(gacc[m], scale, acc[m]);
        if (w.mins) acc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.group_dsum[(m0 + m) * groups + g]), acc[m]);
      }
    }
    for (int m = 0; m < MT && n_here > 0; ++m) {
      float tmp[8];
      _mm256_storeu_ps(tmp, acc[m]);
      std::copy(tmp, tmp + n_here, out + (m0 + m) * ldo + t * kI8TileRows + 8 * half);
    }
  }
}

template <int B>
TLB_AVX2_I8 void run_bits(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  for (int64_t t = t0; t < t1; ++t)
    for_token_blocks(a.M, [&](auto mt, int64_t m0) TLB_AVX2_I8 { tile_tokens<B, decltype(mt)::value>(w, a, t, m0, out, ldo); });
}

}  // namespace

TLB_AVX2_I8 void lut_i8_avx2(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out,
                            int64_t ldo) {
  with_code_bits(w.bits, [&](auto b) TLB_AVX2_I8 { run_bits<decltype(b)::value>(w, a, t0, t1, out, ldo); });
}

}  // namespace torch_lowbit
#endif
