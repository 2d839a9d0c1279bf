// AVX-512 VNNI lut4 x int8 kernel: vpshufb maps codes to unsigned table bytes (16-entry table in
// every 128-bit lane), vpdpbusd accumulates 4 code x activation products per int32 lane, and each
// lane is one output row of the 16-row tile, so no horizontal reductions. Up to 4 tokens share
// each decoded block (register blocking over tokens).
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <algorithm>

#include "common/lut4_i8.h"
#include "common/token_blocks.h"

#define TLB_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

namespace torch_lowbit {
namespace {

// kIdentity: the unsigned table is u[c] = c (q4_0, int4), so the vpshufb lookups are skipped.
template <int MT, bool kIdentity>
TLB_VNNI void tile_tokens(const Lut4I8Weights& w, const Q8Acts& a, int64_t t, int64_t m0, float* out, int64_t ldo) {
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.utable)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* tile = w.qweight + t * kb_count * 256;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t pidx = (t * groups + g) * kI8TileRows;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + pidx)));
    const __m512 mn = w.mins ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + pidx)))
                             : _mm512_setzero_ps();
    for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
      const int64_t b = g * blocks_per_group + bb;
      const uint8_t* p = tile + b * 256;
      __m512i lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        const __m512i packed = _mm512_loadu_si512(p + 64 * i);
        lo[i] = _mm512_and_si512(packed, low4);
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
        if (!kIdentity) {
          lo[i] = _mm512_shuffle_epi8(table, lo[i]);
          hi[i] = _mm512_shuffle_epi8(table, hi[i]);
        }
      }
      for (int m = 0; m < MT; ++m) {
        const int8_t* xq = a.q + (m0 + m) * a.K + b * 32;
        __m512i isum = _mm512_setzero_si512();
        for (int i = 0; i < 4; ++i) isum = _mm512_dpbusd_epi32(isum, lo[i], _mm512_set1_epi32(load_act4(xq + 4 * i)));
        for (int i = 0; i < 4; ++i) isum = _mm512_dpbusd_epi32(isum, hi[i], _mm512_set1_epi32(load_act4(xq + 16 + 4 * i)));
        const int32_t xsum = a.sum[(m0 + m) * kb_count + b];
        const float xd = a.d[(m0 + m) * kb_count + b];
        isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(w.offset * xsum));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale, _mm512_set1_ps(xd)), acc[m]);
        if (w.mins) acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xd * static_cast<float>(xsum)), acc[m]);
      }
    }
  }
  const int64_t rows = std::min(kI8TileRows, w.N - t * kI8TileRows);
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1u);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(out + (m0 + m) * ldo + t * kI8TileRows, mask, acc[m]);
}

}  // namespace

TLB_VNNI void lut4_i8_avx512vnni(const Lut4I8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out,
                                int64_t ldo) {
  bool identity = true;
  for (int i = 0; i < 16; ++i) identity &= w.utable[i] == i;
  for (int64_t t = t0; t < t1; ++t)
    for_token_blocks<8>(a.M, [&](auto mt, int64_t m0) TLB_VNNI {
      if (identity)
        tile_tokens<decltype(mt)::value, true>(w, a, t, m0, out, ldo);
      else
        tile_tokens<decltype(mt)::value, false>(w, a, t, m0, out, ldo);
    });
}

}  // namespace torch_lowbit
#endif
