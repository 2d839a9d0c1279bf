// The AVX-512 VNNI tile kernel of the lut{b}_i8_n16 and gcb_i8_n16 layouts (csrc/common/lut_i8.h).
// Shared by two translation units that compile it for different targets: lut_i8_avx512vnni.cpp
// (AVX-512 VNNI: identity and 16-entry tables) and lut_i8_avx512vbmi.cpp (+ VBMI: the per-row
// codebooks of gcb through vpermb / vpermi2b). The including file defines TLB_KERNEL, the target
// attribute, first.
//
// Shifts and masks cut each 64-byte chunk into 4-code quads, a lookup maps codes to unsigned table
// bytes, vpdpbusd accumulates 4 code x activation products per int32 lane, and each lane is one
// output row of the 16-row tile, so no horizontal reductions. Up to 8 tokens share each decoded
// block (register blocking over tokens).
#pragma once
#include <immintrin.h>

// GCC 12 reports the self-initialized `__Y` of its own _mm512_undefined_* as (maybe-)uninitialized once
// these templates inline deeply enough (GCC bug 105593, fixed in 13): a false positive, silenced here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <algorithm>
#include <cstdint>

#include "common/lut_i8.h"
#include "common/scratch.h"
#include "common/token_blocks.h"

namespace torch_lowbit {
namespace {

struct PreparedTile;  // thread_scratch tag: the prefill's decoded tile

enum class Lookup {
  Identity,     // u[c] = c (q4_0, int*): no lookup
  Table16,      // one <= 16-entry table: vpshufb from a register
  RowCodebook,  // gcb: each row's block picks one of 16 codebooks: vpermb (gcb2) / vpermi2b (gcb3)
};

// The 8 quads of one (tile, block), as lut_i8.h lays them out: field f of a width-W plane's
// chunk c is quad f * W + c.
template <int W>
TLB_KERNEL inline void plane_quads(const uint8_t* p, __m512i q[8]) {
  const __m512i mask = _mm512_set1_epi8((1 << W) - 1);
  for (int c = 0; c < W; ++c) {
    const __m512i chunk = _mm512_loadu_si512(p + 64 * c);
    for (int f = 0; f < 8 / W; ++f) q[f * W + c] = _mm512_and_si512(_mm512_srli_epi16(chunk, W * f), mask);
  }
}

template <int B>
TLB_KERNEL inline void decode_quads(const uint8_t* p, __m512i q[8]) {
  if constexpr (B == 8) {  // chunk qd is quad qd: the code bytes as they are
    for (int qd = 0; qd < 8; ++qd) q[qd] = _mm512_loadu_si512(p + 64 * qd);
  } else if constexpr (B == 3) {  // low two bits from the 2-bit plane, bit 2 from the 1-bit plane
    plane_quads<2>(p, q);
    const __m512i hi = _mm512_loadu_si512(p + 128), bit2 = _mm512_set1_epi8(4);
    for (int f = 0; f < 8; ++f) {
      const __m512i moved = f < 2 ? _mm512_slli_epi16(hi, 2 - f) : _mm512_srli_epi16(hi, f - 2);
      q[f] = _mm512_or_si512(q[f], _mm512_and_si512(moved, bit2));
    }
  } else if constexpr (B == 5 || B == 6) {  // low four bits from the 4-bit plane, the rest from the plane at 256
    plane_quads<4>(p, q);
    __m512i hi[8];
    plane_quads<B - 4>(p + 256, hi);
    for (int f = 0; f < 8; ++f) q[f] = _mm512_or_si512(q[f], _mm512_slli_epi16(hi[f], 4));  // hi < 4: stays in its byte
  } else {
    plane_quads<B>(p, q);
  }
}

// Codes -> unsigned table bytes. sub: the block's 16 sub-group bytes (RowCodebook only); Table16 reads
// tables[0] (pairs: tables[1] for the second coordinate, the caller passes tables + 1).
template <Lookup L, int B>
TLB_KERNEL inline void map_quads(__m512i q[8], const __m512i tables[2], const uint8_t* sub) {
  if constexpr (L == Lookup::Table16) {
    for (int qd = 0; qd < 8; ++qd) q[qd] = _mm512_shuffle_epi8(tables[0], q[qd]);
  } else if constexpr (L == Lookup::RowCodebook) {
    // row r's byte to the 4 bytes of int32 lane r, then its codebook nibble moved to c << B
    const __m512i lane_of_byte = _mm512_set_epi32(0x0F0F0F0F, 0x0E0E0E0E, 0x0D0D0D0D, 0x0C0C0C0C, 0x0B0B0B0B,
                                                  0x0A0A0A0A, 0x09090909, 0x08080808, 0x07070707, 0x06060606,
                                                  0x05050505, 0x04040404, 0x03030303, 0x02020202, 0x01010101, 0);
    const __m512i spread = _mm512_permutexvar_epi8(
        lane_of_byte, _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub))));
    const __m512i select = _mm512_and_si512(_mm512_srli_epi16(spread, 4 - B), _mm512_set1_epi8(char(0xF << B)));
    for (int qd = 0; qd < 8; ++qd) {
      const __m512i idx = _mm512_or_si512(q[qd], select);
      q[qd] = B == 2 ? _mm512_permutexvar_epi8(idx, tables[0]) : _mm512_permutex2var_epi8(tables[0], idx, tables[1]);
    }
  }
}

// The lookup's tables in registers (pairs: the second coordinate's table in tables[1]).
template <Lookup L, int B>
TLB_KERNEL inline void load_tables(const LutI8Weights& w, __m512i tables[2]) {
  if constexpr (L == Lookup::RowCodebook) {
    tables[0] = _mm512_loadu_si512(w.utable);
    tables[1] = _mm512_loadu_si512(w.utable + 64);
  } else {
    tables[0] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.utable)));
    if constexpr (B <= 4)
      tables[1] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.utable + (1 << B))));
  }
}

// gcb: the 16 sub-group bytes of (tile t, block b) and the rows' sub-scales as floats.
TLB_KERNEL inline const uint8_t* row_sub_groups(const LutI8Weights& w, int64_t t, int64_t b) {
  return w.sub_groups + (t * (w.K / 32) + b) * kI8TileRows;
}
TLB_KERNEL inline __m512 row_sub_scales(const uint8_t* sub) {
  return _mm512_cvtepi32_ps(
      _mm512_and_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub))), _mm512_set1_epi32(15)));
}

// One token's products with one tile's mapped block (quad): into its int32 group sums ilo / ihi (PT),
// straight into acc with the group's scale and min (OneBlockGroups), or into its group accumulator.
template <Lookup L, bool PT, bool OneBlockGroups, bool TwoChains>
TLB_KERNEL __attribute__((always_inline)) inline void token_block(const LutI8Weights& w, const Q8Acts& a, int64_t token,
                                                                 int64_t b, int64_t g, int64_t kb_count, int64_t groups,
                                                                 const __m512i* quad, __m512 step, __m512 gscale,
                                                                 __m512 gmin, __m512& acc, __m512& gacc, __m512i& ilo,
                                                                 __m512i& ihi) {
  const int8_t* xq = a.q + token * a.K + b * 32;
  if constexpr (PT) {  // one chain per (tile, token) once there are enough of them to hide the latency
    __m512i& hi = TwoChains ? ihi : ilo;
    for (int qd = 0; qd < 4; ++qd) {
      ilo = _mm512_dpbusd_epi32(ilo, quad[qd], _mm512_set1_epi32(load_act4(xq + 4 * qd)));
      hi = _mm512_dpbusd_epi32(hi, quad[qd + 4], _mm512_set1_epi32(load_act4(xq + 16 + 4 * qd)));
    }
    return;
  }
  // two chains of 4 (not one of 8): the dpbusd latency is what a single token waits on
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
  for (int qd = 0; qd < 4; ++qd) {
    lo = _mm512_dpbusd_epi32(lo, quad[qd], _mm512_set1_epi32(load_act4(xq + 4 * qd)));
    hi = _mm512_dpbusd_epi32(hi, quad[qd + 4], _mm512_set1_epi32(load_act4(xq + 16 + 4 * qd)));
  }
  __m512i isum = _mm512_add_epi32(lo, hi);
  if (w.offset) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(w.offset * a.sum[token * kb_count + b]));
  __m512 factor = _mm512_set1_ps(a.d[token * kb_count + b]);
  if constexpr (L == Lookup::RowCodebook) factor = _mm512_mul_ps(step, factor);
  if constexpr (OneBlockGroups) {
    const __m512 product = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), factor, _mm512_setzero_ps());
    acc = _mm512_fmadd_ps(product, gscale, acc);
    if (w.mins) acc = _mm512_fmadd_ps(gmin, _mm512_set1_ps(a.group_dsum[token * groups + g]), acc);
    return;
  }
  gacc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), factor, gacc);
}

// NT tiles (consecutive, t .. t+NT-1) x MT tokens per pass: NT > 1 keeps several weight streams in
// flight per thread, which is what decode (M = 1) is bound by. PT: per-token activations, whose
// group sums stay in int32 (two vpdpbusd chains per tile and token across the whole group, the
// offset subtracted once per group from the token's group sum of q).
// Prepared: the quads come from `prepared` (prepare_tile's buffer of tile t) instead of the codes.
// OneBlockGroups (groups of 32, per-32 activations): each block's product goes straight into acc with
// the group's scale, loaded first, instead of through NT * MT group accumulators - the same roundings
// (fma with zero, then fma with the scale). With acc and the group accumulators (2 x 8 zmm at 8
// tokens) a table lookup's registers made GCC 12 keep both on the stack across groups: iq4_nl ran at
// 1.3x q4_0's time on Zen 4 (M = 16-128), q4_0 itself 1.37x slower at M = 4 than without them.
template <Lookup L, int B, int NT, int MT, bool PT, bool Prepared = false, bool OneBlockGroups = false>
TLB_KERNEL void tiles_tokens(const LutI8Weights& w, const Q8Acts& a, int64_t t, int64_t m0, float* out, int64_t ldo,
                             const __m512i* prepared = nullptr) {
  static_assert(!Prepared || NT == 1, "a prepared buffer holds one tile");
  static_assert(!OneBlockGroups || !PT, "per-token activations keep their int32 group sums");
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  constexpr bool kTwoChains = NT * MT < 4;
  __m512i tables[2];
  load_tables<L, B>(w, tables);
  __m512i codes[NT][8] = {};  // pairs: the code block of the even block, mapped again for the odd one
  __m512 acc[NT][MT];
  __mmask16 row_mask[NT];
  for (int n = 0; n < NT; ++n) {
    const int64_t rows = std::min(kI8TileRows, w.N - (t + n) * kI8TileRows);
    row_mask[n] = static_cast<__mmask16>((1u << rows) - 1u);
    const __m512 start = w.bias ? _mm512_maskz_loadu_ps(row_mask[n], w.bias + (t + n) * kI8TileRows) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) acc[n][m] = start;
  }
  // tile n's scales (and mins) of group g, fp16 -> fp32
  auto group_scale = [&](int n, int64_t g) TLB_KERNEL {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + ((t + n) * groups + g) * kI8TileRows)));
  };
  auto group_min = [&](int n, int64_t g) TLB_KERNEL {
    return w.mins ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + ((t + n) * groups + g) * kI8TileRows)))
                  : _mm512_setzero_ps();
  };
  for (int64_t g = 0; g < groups; ++g) {
    __m512 gacc[NT][MT];
    __m512i ilo[NT][MT], ihi[NT][MT];  // PT
    __m512 gscale[NT] = {}, gmin[NT] = {};  // OneBlockGroups
    for (int n = 0; n < NT; ++n) {
      if constexpr (OneBlockGroups) {
        gscale[n] = group_scale(n, g);
        gmin[n] = group_min(n, g);
        continue;
      }
      for (int m = 0; m < MT; ++m) {
        gacc[n][m] = _mm512_setzero_ps();
        if constexpr (PT) ilo[n][m] = ihi[n][m] = _mm512_setzero_si512();
      }
    }
    for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
      const int64_t b = g * blocks_per_group + bb;
      __m512i quad[NT][8];
      __m512 steps[NT] = {};  // gcb: the rows' sub-scales
      for (int n = 0; n < NT; ++n) {
        if constexpr (Prepared) {  // NT == 1: the tile's mapped quads, prepared once per call
          for (int qd = 0; qd < 8; ++qd) quad[n][qd] = _mm512_load_si512(prepared + 8 * b + qd);
          if constexpr (L == Lookup::RowCodebook) steps[n] = row_sub_scales(row_sub_groups(w, t, b));
          continue;
        }
        if (!w.pairs || (b & 1) == 0) {
          const uint8_t* p = lut_i8_block(w, t + n, b);
          for (int c = 0; c < B; ++c)
            _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + 64 * c), _MM_HINT_T0);
          decode_quads<B>(p, codes[n]);
        }
        for (int qd = 0; qd < 8; ++qd) quad[n][qd] = codes[n][qd];
        const uint8_t* sub = nullptr;
        if constexpr (L == Lookup::RowCodebook) {
          sub = row_sub_groups(w, t + n, b);
          steps[n] = row_sub_scales(sub);
        }
        map_quads<L, B>(quad[n], tables + (w.pairs && (b & 1)), sub);
      }
      // The token loop unrolled: rolled, it indexes acc / gacc, which then live on the stack (a load, fma
      // and store per block and token: int4_g32 took 1.4x int4_g128's time at M = 64 on Zen 4; 1.11-1.17x
      // faster unrolled). Not with a prepared tile (nuq3 5-10% slower unrolled).
#define TLB_TOKEN_BLOCKS(m)                                                                                   \
  for (int n = 0; n < NT; ++n)                                                                               \
    token_block<L, PT, OneBlockGroups, kTwoChains>(w, a, m0 + m, b, g, kb_count, groups, quad[n], steps[n], gscale[n], \
                                                   gmin[n], acc[n][m], gacc[n][m], ilo[n][m], ihi[n][m])
      if constexpr (Prepared) {
        for (int m = 0; m < MT; ++m) TLB_TOKEN_BLOCKS(m);
      } else {
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) TLB_TOKEN_BLOCKS(m);
      }
#undef TLB_TOKEN_BLOCKS
    }
    if constexpr (OneBlockGroups) continue;
    for (int n = 0; n < NT; ++n) {
      const __m512 scale = group_scale(n, g), mn = group_min(n, g);
      for (int m = 0; m < MT; ++m) {
        if constexpr (PT) {
          __m512i isum = kTwoChains ? _mm512_add_epi32(ilo[n][m], ihi[n][m]) : ilo[n][m];
          if (w.offset) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(w.offset * a.group_qsum[(m0 + m) * groups + g]));
          gacc[n][m] = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(a.d[(m0 + m) * kb_count]));
        }
        acc[n][m] = _mm512_fmadd_ps(gacc[n][m], scale, acc[n][m]);
        if (w.mins) acc[n][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.group_dsum[(m0 + m) * groups + g]), acc[n][m]);
      }
    }
  }
  for (int n = 0; n < NT; ++n)
    for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(out + (m0 + m) * ldo + (t + n) * kI8TileRows, row_mask[n], acc[n][m]);
}

// Every token block of tile t (NT tiles from t); Prepared: from the tile's prepared quads.
template <Lookup L, int B, int NT, bool Prepared = false>
TLB_KERNEL void run_tiles(const LutI8Weights& w, const Q8Acts& a, int64_t t, float* out, int64_t ldo,
                          const __m512i* prepared = nullptr) {
  if constexpr (L != Lookup::RowCodebook) {
    if (a.per_token) {
      for_token_blocks<8 / NT>(a.M, [&](auto mt, int64_t m0) TLB_KERNEL {
        tiles_tokens<L, B, NT, decltype(mt)::value, true, Prepared>(w, a, t, m0, out, ldo, prepared);
      });
      return;
    }
  }
  if (w.group == 32 && !w.pairs) {
    for_token_blocks<8 / NT>(a.M, [&](auto mt, int64_t m0) TLB_KERNEL {
      tiles_tokens<L, B, NT, decltype(mt)::value, false, Prepared, true>(w, a, t, m0, out, ldo, prepared);
    });
    return;
  }
  for_token_blocks<8 / NT>(a.M, [&](auto mt, int64_t m0) TLB_KERNEL {
    tiles_tokens<L, B, NT, decltype(mt)::value, false, Prepared>(w, a, t, m0, out, ldo, prepared);
  });
}

// Tile t's codes decoded and looked up once into buf (8 quads of 64 bytes per block: 16 bytes per
// feature, L2-resident), for prefill: the token blocks then only load them.
template <Lookup L, int B>
TLB_KERNEL void prepare_tile(const LutI8Weights& w, int64_t t, __m512i* buf) {
  __m512i tables[2];
  load_tables<L, B>(w, tables);
  __m512i codes[8] = {};  // pairs: the even block's codes, mapped again for the odd one
  for (int64_t b = 0; b < w.K / 32; ++b) {
    if (!w.pairs || (b & 1) == 0) {
      const uint8_t* p = lut_i8_block(w, t, b);
      for (int c = 0; c < B; ++c) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + 64 * c), _MM_HINT_T0);
      decode_quads<B>(p, codes);
    }
    __m512i quad[8];
    for (int qd = 0; qd < 8; ++qd) quad[qd] = codes[qd];
    map_quads<L, B>(quad, tables + (w.pairs && (b & 1)), L == Lookup::RowCodebook ? row_sub_groups(w, t, b) : nullptr);
    for (int qd = 0; qd < 8; ++qd) _mm512_store_si512(buf + 8 * b + qd, quad[qd]);
  }
}

template <Lookup L, int B>
TLB_KERNEL void run_range(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  // More than one token block (prefill) with a costly decode (a table on 3-bit planes, per-row
  // codebooks): each tile decoded once per call into a buffer instead of once per 8 tokens (M = 64 on
  // Zen 4: nuq3 1.15-1.2x, gcb2 1.18x, gcb3 1.25x faster). Not for identity or 4-bit codes: reading
  // the 16 bytes per feature back from L2 cost more than decoding the packed codes again (q4_0 1.3x,
  // int2_g64 1.15x, int3_g64 1.05x slower; iq4_nl and vq2 no faster).
  if constexpr (L == Lookup::RowCodebook || (L == Lookup::Table16 && B == 3)) {
    if (a.M > 8) {
      auto* buf = reinterpret_cast<__m512i*>(thread_scratch<PreparedTile>((w.K / 32) * 8 * sizeof(__m512i)));
      for (int64_t t = t0; t < t1; ++t) {
        prepare_tile<L, B>(w, t, buf);
        run_tiles<L, B, 1, true>(w, a, t, out, ldo, buf);
      }
      return;
    }
  }
  int64_t t = t0;
  // Few tokens: stream two tiles per pass (identity tables: measured 12-25% faster at M = 1..4). Not
  // with a 16-entry table (iq4_nl, nuq, vq): 2 x 8 mapped quads plus the tables spill, and one tile per
  // pass was 1.1-1.7x faster on Zen 4 (2026-11-27).
  if (a.M <= 4 && L != Lookup::Table16)
    for (; t + 2 <= t1; t += 2) run_tiles<L, B, 2>(w, a, t, out, ldo);
  for (; t < t1; ++t) run_tiles<L, B, 1>(w, a, t, out, ldo);
}

}  // namespace
}  // namespace torch_lowbit

#pragma GCC diagnostic pop
