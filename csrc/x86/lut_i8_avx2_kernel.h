// The 256-bit tile kernel of the lut{b}_i8_n16 and gcb_i8_n16 layouts (csrc/common/lut_i8.h), shared by
// two translation units that compile it for different targets: lut_i8_avx2.cpp (AVX2: vpmaddubsw) and
// lut_i8_avxvnni.cpp (AVX2 + AVX-VNNI: vpdpbusd on ymm, Intel Alder Lake and later, AMD Zen 5; and
// lut_i8_avxvnni_evex.cpp, the same instruction EVEX-encoded for AVX512-VNNI CPUs without AVX-VNNI). The
// including file defines TLB_KERNEL, the target attribute, first (and TLB_DPBUSD_YMM for a Vnni dot).
//
// A 16-row tile is two 8-lane halves (bytes 0..31 and 32..63 of each 64-byte chunk); each int32 lane
// is one row, so there is no horizontal reduction. Per (tile, 32-block, half) the codes become 8
// "prepared" quad vectors (shift, mask, table lookup) and every token then needs only integer dot
// products against 4 broadcast activations per quad. How the products are summed depends on the
// table's unsigned bytes u = t + offset (all give the same integer isum, so the float epilogue - the
// same ops in the same order as the scalar path - is bit-identical):
//   Small    (u <= 16): vpmaddubsw(u, x) pairs summed in int16 over all 8 quads (|sum| <= 16*16*127),
//            one vpmaddwd at the end; offset * sum(x) subtracted. q4_0, int4_g*, int2/int3, ...
//   Unsigned (u <= 129): vpmaddubsw + vpmaddwd per quad (each pair <= 2*129*127 < 2^15, no saturation).
//   Signed   (else: iq4_nl, q8_0, wide codebooks): vpmaddubsw(|t|, sign(x, t)) + vpmaddwd, both
//            factors within +-127 (the sign trick; q8_0's byte -128, which ggml never writes, still
//            works: |t| = 0x80 is read as the unsigned 128).
//   Vnni     (AVX-VNNI): two chains of vpdpbusd(u, x), offset * sum(x) subtracted.
// Few tokens (decode) prepare each block (both halves) and run up to 4 tokens against it; more tokens
// (prefill) prepare the whole tile once into a per-thread buffer (16 bytes per feature, L2-resident)
// and run every token block against it, both halves at once so each activation broadcast feeds two
// products: each weight byte is decoded once per call instead of once per 4 tokens.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/lut_i8.h"
#include "common/scratch.h"
#include "common/token_blocks.h"

#ifndef TLB_DPBUSD_YMM
#define TLB_DPBUSD_YMM _mm256_dpbusd_avx_epi32  // AVX-VNNI (VEX)
#endif

namespace torch_lowbit {
namespace {

struct PreparedTile;  // thread_scratch tag: the prefill's decoded tile

enum class Dot { Small, Unsigned, Signed, Vnni };

// Tokens per register block; above it (prefill) the tile is prepared once into a buffer.
constexpr int kTokenBlock = 4;

// The 8 quads of one half tile (p already offset by 32 * half), as lut_i8.h lays them out.
template <int W>
TLB_KERNEL inline void plane_quads(const uint8_t* p, __m256i q[8]) {
  const __m256i mask = _mm256_set1_epi8((1 << W) - 1);
  for (int c = 0; c < W; ++c) {
    const __m256i chunk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c));
    for (int f = 0; f < 8 / W; ++f) q[f * W + c] = _mm256_and_si256(_mm256_srli_epi16(chunk, W * f), mask);
  }
}

template <int B>
TLB_KERNEL inline void decode_quads(const uint8_t* p, __m256i q[8]) {
  if constexpr (B == 8) {  // chunk qd is quad qd: the code bytes as they are
    for (int qd = 0; qd < 8; ++qd) q[qd] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * qd));
  } else if constexpr (B == 3) {
    plane_quads<2>(p, q);
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128)), bit2 = _mm256_set1_epi8(4);
    for (int f = 0; f < 8; ++f) {
      const __m256i moved = f < 2 ? _mm256_slli_epi16(hi, 2 - f) : _mm256_srli_epi16(hi, f - 2);
      q[f] = _mm256_or_si256(q[f], _mm256_and_si256(moved, bit2));
    }
  } else if constexpr (B == 5 || B == 6) {  // low four bits from the 4-bit plane, the rest from the plane at 256
    plane_quads<4>(p, q);
    __m256i hi[8];
    plane_quads<B - 4>(p + 256, hi);
    for (int f = 0; f < 8; ++f) q[f] = _mm256_or_si256(q[f], _mm256_slli_epi16(hi[f], 4));  // hi < 4: stays in its byte
  } else {
    plane_quads<B>(p, q);
  }
}

// What a kernel instance looks codes up in: the Signed dot reads signed table bytes, the others the
// unsigned ones; identity tables (u[c] = c) skip the lookup.
struct TableBytes {
  alignas(32) int8_t bytes[128];  // the most a <= 4-bit lookup reads (gcb3: 16 codebooks x 8)
  alignas(32) int32_t halves[32];  // gcb3: each codebook's entries 0-3 (words 0..15), then 4-7 (16..31)
  bool identity;
};

template <Dot D>
TableBytes table_bytes(const LutI8Weights& w) {
  TableBytes t;
  bool identity = w.bits != 8 && !w.sub_groups && !w.pairs;
  for (int i = 0; i < 128; ++i) {
    t.bytes[i] = static_cast<int8_t>(D == Dot::Signed ? w.utable[i] - w.offset : w.utable[i]);
    if (i < (1 << w.bits) && w.bits != 8) identity &= w.utable[i] == i;
  }
  for (int cb = 0; cb < 16; ++cb) {
    std::memcpy(&t.halves[cb], t.bytes + 8 * cb, 4);
    std::memcpy(&t.halves[16 + cb], t.bytes + 8 * cb + 4, 4);
  }
  t.identity = identity && D != Dot::Signed;
  return t;
}

// words[idx] per lane for idx in 0..15, the 16 words in two registers: vpermd reads idx's low 3 bits,
// bit 3 picks the register (2 vpermd + a blend: cheaper than an 8-lane vpgatherdd, ~9 uops on AMD Zen).
TLB_KERNEL inline __m256i pick_word16(const int32_t* words, __m256i idx) {
  const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(words)), idx);
  const __m256i hi = _mm256_permutevar8x32_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(words + 8)), idx);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi),
                                              _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28))));
}

// Table bytes of the 8 quads of one half tile from the <= 16-entry table at `base` (pairs: each
// coordinate's table) or gcb's per-row codebooks (sub: that half's 8 sub-group bytes, or nullptr). Codebooks:
// each row's 4-entry codebook (gcb3: two words, entries 0-3 and 4-7) is picked into the row's own lane
// (pick_word16), so vpshufb looks codes up within the lane (blend on bit 2 for gcb3).
template <int B>
TLB_KERNEL inline void lookup_quads(__m256i q[8], const TableBytes& tab, const uint8_t* sub, int base) {
  if (!sub) {
    if (tab.identity) return;
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tab.bytes + base)));
    for (int qd = 0; qd < 8; ++qd) q[qd] = _mm256_shuffle_epi8(table, q[qd]);
    return;
  }
  const __m256i cb = _mm256_srli_epi32(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub))), 4);  // codebook per row
  const __m256i lane_base = _mm256_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0);
  if constexpr (B == 2) {
    const __m256i rows = pick_word16(reinterpret_cast<const int32_t*>(tab.bytes), cb);  // 4 entries per word
    for (int qd = 0; qd < 8; ++qd) q[qd] = _mm256_shuffle_epi8(rows, _mm256_or_si256(q[qd], lane_base));
  } else {
    const __m256i lo = pick_word16(tab.halves, cb);
    const __m256i hi = pick_word16(tab.halves + 16, cb);
    for (int qd = 0; qd < 8; ++qd) {
      const __m256i idx = _mm256_or_si256(_mm256_and_si256(q[qd], _mm256_set1_epi8(3)), lane_base);
      q[qd] = _mm256_blendv_epi8(_mm256_shuffle_epi8(lo, idx), _mm256_shuffle_epi8(hi, idx), _mm256_slli_epi16(q[qd], 5));
    }
  }
}

// One (tile, block, half) ready for the dot products: u (or |t| for Signed) and, for Signed, t.
// LateAbs (Signed, decode): u holds t itself and |t| is taken at each use (one vpabsb): a block's u and
// t for two halves are 32 vectors and spill, t alone is 16; the prefill buffer keeps both (|t| once
// per tile instead of once per token block).
template <Dot D, bool LateAbs = false>
struct PreparedHalf {
  static constexpr bool late_abs = LateAbs && D == Dot::Signed;
  __m256i u[8];
  __m256i t[D == Dot::Signed && !late_abs ? 8 : 1];
};

// Codes already in out.u -> the prepared half (table at `base`).
template <Dot D, int B, bool LateAbs>
TLB_KERNEL inline void map_half(const TableBytes& tab, const uint8_t* sub, int base, PreparedHalf<D, LateAbs>& out) {
  constexpr bool late = PreparedHalf<D, LateAbs>::late_abs;
  __m256i* t = late ? out.u : out.t;  // where the signed values go
  if constexpr (B == 8) {  // q8_0: u is the byte itself (offset 128); t = byte ^ 0x80
    if constexpr (D == Dot::Signed)
      for (int qd = 0; qd < 8; ++qd) t[qd] = _mm256_xor_si256(out.u[qd], _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    lookup_quads<B>(out.u, tab, sub, base);
    if constexpr (D == Dot::Signed && !late)
      for (int qd = 0; qd < 8; ++qd) out.t[qd] = out.u[qd];
  }
  if constexpr (D == Dot::Signed && !late)
    for (int qd = 0; qd < 8; ++qd) out.u[qd] = _mm256_abs_epi8(out.t[qd]);
}

// Half h of (tile t, block b) prepared into `out`. Pairs (a compile-time case, so the other layouts'
// loop stays as it was): an even block decodes its code block into `codes`, the odd block after it
// maps the same codes through the second table.
template <Dot D, int B, bool Pairs, bool LateAbs>
TLB_KERNEL inline void prepare_half(const LutI8Weights& w, const TableBytes& tab, int64_t t, int64_t b, int h,
                                    const uint8_t* sub, __m256i (&codes)[8], PreparedHalf<D, LateAbs>& out) {
  // the first half of a code block prefetches the block kPrefetchBytes ahead (as the AVX-512 kernel)
  auto prefetch = [](const uint8_t* p) TLB_KERNEL {
    for (int c = 0; c < B; ++c) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + 64 * c), _MM_HINT_T0);
  };
  if constexpr (Pairs) {
    if ((b & 1) == 0) {
      const uint8_t* p = lut_i8_block(w, t, b);
      if (h == 0) prefetch(p);
      decode_quads<B>(p + 32 * h, codes);
    }
    for (int qd = 0; qd < 8; ++qd) out.u[qd] = codes[qd];
    map_half<D, B>(tab, sub, lut_i8_table_base(w, b), out);
  } else {
    const uint8_t* p = w.qweight + (t * (w.K / 32) + b) * (64 * B);
    if (h == 0) prefetch(p);
    decode_quads<B>(p + 32 * h, out.u);
    map_half<D, B>(tab, sub, 0, out);
  }
}

// Keeps v in a register at this point: stops GCC from re-associating the integer sums below into a
// tree, which keeps every product alive at once and spills them to the stack.
TLB_KERNEL inline void pin(__m256i& v) { asm("" : "+x"(v)); }

// isum[m][k] of MT tokens (activations xq[m], already at the block) against NH halves. The quad loop is
// outermost: each prepared vector is loaded once and feeds every token, each broadcast activation
// word feeds every half, and the MT x NH sums stay in registers (no spills at 4 x 2). Offset: subtract
// offset_sums here (per-token activations do it once per group instead).
template <Dot D, int NH, int MT, bool Offset = true, typename Half>
TLB_KERNEL __attribute__((always_inline)) inline void block_isums(const Half* h, const int8_t* const* xq,
                                                                  const int32_t* offset_sums, __m256i (&isum)[MT][NH]) {
  #pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
    #pragma GCC unroll 8
    for (int k = 0; k < NH; ++k) isum[m][k] = _mm256_setzero_si256();
  #pragma GCC unroll 8
  for (int qd = 0; qd < 8; ++qd) {
    __m256i u[NH], t[NH];  // t: Signed
    #pragma GCC unroll 8
    for (int k = 0; k < NH; ++k) {
      u[k] = _mm256_load_si256(&h[k].u[qd]);
      if constexpr (Half::late_abs) {
        t[k] = u[k];
        u[k] = _mm256_abs_epi8(t[k]);
      } else if constexpr (D == Dot::Signed) {
        t[k] = _mm256_load_si256(&h[k].t[qd]);
      }
    }
    #pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m256i x = _mm256_set1_epi32(load_act4(xq[m] + 4 * qd));
      #pragma GCC unroll 8
      for (int k = 0; k < NH; ++k) {
        if constexpr (D == Dot::Vnni) {
          isum[m][k] = TLB_DPBUSD_YMM(isum[m][k], u[k], x);
        } else if constexpr (D == Dot::Small) {  // int16 sums here, widened below
          isum[m][k] = _mm256_add_epi16(isum[m][k], _mm256_maddubs_epi16(u[k], x));
          pin(isum[m][k]);
        } else {
          const __m256i xs = D == Dot::Signed ? _mm256_sign_epi8(x, t[k]) : x;
          isum[m][k] = _mm256_add_epi32(isum[m][k], _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], xs), _mm256_set1_epi16(1)));
          pin(isum[m][k]);
        }
      }
    }
  }
  #pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
    #pragma GCC unroll 8
    for (int k = 0; k < NH; ++k) {
      if constexpr (D == Dot::Small) isum[m][k] = _mm256_madd_epi16(isum[m][k], _mm256_set1_epi16(1));
      if constexpr (D != Dot::Signed && Offset) isum[m][k] = _mm256_sub_epi32(isum[m][k], _mm256_set1_epi32(offset_sums[m]));
    }
}

// gcb: the 8 rows' sub-scales of a half block as floats (the block factor is s * xd).
TLB_KERNEL inline __m256 sub_scales(const uint8_t* sub) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub))),
                                             _mm256_set1_epi32(15)));
}

// The 8 rows of half h of tile t: fp16 scales (or mins) of group g.
TLB_KERNEL inline __m256 half_params(const c10::Half* p, int64_t groups, int64_t t, int64_t g, int h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (t * groups + g) * kI8TileRows + 8 * h)));
}

// Tokens [m0, m0 + MT) against NH halves (from h0) of tile t; prepared(b) gives the NH halves of
// block b (decoded now, or read from the prefill buffer); Sub: group codebooks (per-row sub-scales);
// PT: per-token activations (the group's isums add up in int32, converted once per group). The
// float epilogue per block and group is the scalar path's. The per-group accumulators stay in
// registers; the running sums live in memory (touched once per group), which leaves the registers
// to the block loop.
template <Dot D, bool Sub, bool PT, int NH, int MT, typename Prepared>
TLB_KERNEL __attribute__((always_inline)) inline void run_tokens(const LutI8Weights& w, const Q8Acts& a, int64_t t,
                                                                 int h0, int64_t m0, float* out, int64_t ldo,
                                                                 Prepared prepared) {
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  alignas(32) float acc[MT][NH][8];
  for (int k = 0; k < NH; ++k) {
    const int64_t row0 = t * kI8TileRows + 8 * (h0 + k);
    for (int r = 0; r < 8; ++r) {
      const float start = w.bias && row0 + r < w.N ? w.bias[row0 + r] : 0.f;
      for (int m = 0; m < MT; ++m) acc[m][k][r] = start;
    }
  }
  const int8_t* xq[MT];
  const float* xd[MT];
  const int32_t* xs[MT];
  #pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    xq[m] = a.q + (m0 + m) * a.K;
    xd[m] = a.d + (m0 + m) * kb_count;
    xs[m] = a.sum + (m0 + m) * kb_count;
  }
  const uint8_t* sub = Sub ? w.sub_groups + t * kb_count * kI8TileRows + 8 * h0 : nullptr;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 gacc[MT][NH];
    __m256i gisum[MT][NH];  // PT
    #pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
      #pragma GCC unroll 8
      for (int k = 0; k < NH; ++k) {
        gacc[m][k] = _mm256_setzero_ps();
        if constexpr (PT) gisum[m][k] = _mm256_setzero_si256();
      }
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      const auto* halves = prepared(b);
      const int8_t* xb[MT];
      int32_t offset_sums[MT];
      #pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        xb[m] = xq[m] + b * 32;
        offset_sums[m] = w.offset * xs[m][b];
      }
      __m256i isum[MT][NH];
      block_isums<D, NH, MT, !PT>(halves, xb, offset_sums, isum);
      if constexpr (PT) {
        #pragma GCC unroll 8
        for (int m = 0; m < MT; ++m)
          #pragma GCC unroll 8
          for (int k = 0; k < NH; ++k) gisum[m][k] = _mm256_add_epi32(gisum[m][k], isum[m][k]);
        continue;
      }
      #pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m256 factor = _mm256_broadcast_ss(xd[m] + b);
        #pragma GCC unroll 8
        for (int k = 0; k < NH; ++k)
          gacc[m][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m][k]),
                                       Sub ? _mm256_mul_ps(sub_scales(sub + b * kI8TileRows + 8 * k), factor) : factor,
                                       gacc[m][k]);
      }
    }
    #pragma GCC unroll 8
    for (int k = 0; k < NH; ++k) {
      const __m256 scale = half_params(w.scales, groups, t, g, h0 + k);
      const __m256 mn = w.mins ? half_params(w.mins, groups, t, g, h0 + k) : _mm256_setzero_ps();
      #pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        if constexpr (PT) {
          __m256i gs = gisum[m][k];
          if constexpr (D != Dot::Signed)
            gs = _mm256_sub_epi32(gs, _mm256_set1_epi32(w.offset * a.group_qsum[(m0 + m) * groups + g]));
          gacc[m][k] = _mm256_mul_ps(_mm256_cvtepi32_ps(gs), _mm256_set1_ps(xd[m][0]));
        }
        __m256 v = _mm256_fmadd_ps(gacc[m][k], scale, _mm256_load_ps(acc[m][k]));
        if (w.mins) v = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.group_dsum[(m0 + m) * groups + g]), v);
        _mm256_store_ps(acc[m][k], v);
      }
    }
  }
  for (int k = 0; k < NH; ++k) {
    const int64_t row0 = t * kI8TileRows + 8 * (h0 + k), n_here = std::min<int64_t>(8, w.N - row0);
    for (int m = 0; m < MT && n_here > 0; ++m) std::copy(acc[m][k], acc[m][k] + n_here, out + (m0 + m) * ldo + row0);
  }
}

// Few tokens: each block decoded once per block of up to 4 tokens, both halves at once, so each
// broadcast activation and each block's scalar work serve 16 rows (21% fewer instructions per weight
// for q4_0 at M = 1; gcb2 7%, since LateAbs); gcb3's two-word row codebooks and vq's per-block-pair codes
// run one half at a time, where two halves' prepared vectors no longer fit the registers.
template <Dot D, bool Sub, bool PT, int B, bool Pairs>
TLB_KERNEL void tile_decode_tokens(const LutI8Weights& w, const TableBytes& tab, const Q8Acts& a, int64_t t, float* out,
                                   int64_t ldo) {
  constexpr int NH = Pairs || (Sub && B == 3) ? 1 : 2;
  const int64_t kb_count = w.K / 32;
  auto run_halves = [&](auto first_half) TLB_KERNEL {
    constexpr int h0 = decltype(first_half)::value;
    for_token_blocks<kTokenBlock>(a.M, [&](auto mt, int64_t m0) TLB_KERNEL {
      PreparedHalf<D, true> halves[NH];
      __m256i codes[NH][8] = {};  // pairs
      run_tokens<D, Sub, PT, NH, decltype(mt)::value>(w, a, t, h0, m0, out, ldo, [&](int64_t b) TLB_KERNEL {
        for (int k = 0; k < NH; ++k) {
          const uint8_t* sub = Sub ? w.sub_groups + (t * kb_count + b) * kI8TileRows + 8 * (h0 + k) : nullptr;
          prepare_half<D, B, Pairs>(w, tab, t, b, h0 + k, sub, codes[k], halves[k]);
        }
        return static_cast<const PreparedHalf<D, true>*>(halves);
      });
    });
  };
  run_halves(std::integral_constant<int, 0>{});
  if (NH == 1 && t * kI8TileRows + 8 < w.N) run_halves(std::integral_constant<int, 1>{});
}

// Many tokens: the tile's blocks prepared once into `buf` (2 halves per block, 32-byte aligned), then
// every token block runs both halves against them.
template <Dot D, bool Sub, bool PT, int B, bool Pairs>
TLB_KERNEL void tile_prefill(const LutI8Weights& w, const TableBytes& tab, const Q8Acts& a, int64_t t,
                             PreparedHalf<D>* buf, float* out, int64_t ldo) {
  const int64_t kb_count = w.K / 32;
  __m256i codes[2][8] = {};
  for (int64_t b = 0; b < kb_count; ++b)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* sub = Sub ? w.sub_groups + (t * kb_count + b) * kI8TileRows + 8 * h : nullptr;
      prepare_half<D, B, Pairs>(w, tab, t, b, h, sub, codes[h], buf[2 * b + h]);
    }
  const PreparedHalf<D>* prepared = buf;
  for_token_blocks<kTokenBlock>(a.M, [&](auto mt, int64_t m0) TLB_KERNEL {
    run_tokens<D, Sub, PT, 2, decltype(mt)::value>(w, a, t, 0, m0, out, ldo,
                                          [&](int64_t b) TLB_KERNEL { return prepared + 2 * b; });
  });
}

template <Dot D, bool Sub, bool PT, int B, bool Pairs = false>
TLB_KERNEL void run_tiles(const LutI8Weights& w, const TableBytes& tab, const Q8Acts& a, int64_t t0, int64_t t1,
                          float* out, int64_t ldo) {
  if (a.M <= kTokenBlock) {
    for (int64_t t = t0; t < t1; ++t) tile_decode_tokens<D, Sub, PT, B, Pairs>(w, tab, a, t, out, ldo);
    return;
  }
  auto* buf = reinterpret_cast<PreparedHalf<D>*>(thread_scratch<PreparedTile>(2 * (w.K / 32) * sizeof(PreparedHalf<D>)));
  for (int64_t t = t0; t < t1; ++t) tile_prefill<D, Sub, PT, B, Pairs>(w, tab, a, t, buf, out, ldo);
}

template <Dot D, int B>
TLB_KERNEL void run_range(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  const TableBytes tab = table_bytes<D>(w);
  if constexpr (B == 2 || B == 3) {  // group codebooks
    if (w.sub_groups) return run_tiles<D, true, false, B>(w, tab, a, t0, t1, out, ldo);
  }
  if constexpr (B <= 4) {  // pair codebooks (vq): weight-only activations (the op checks)
    if (w.pairs) return run_tiles<D, false, false, B, true>(w, tab, a, t0, t1, out, ldo);
  }
  if (a.per_token) return run_tiles<D, false, true, B>(w, tab, a, t0, t1, out, ldo);
  run_tiles<D, false, false, B>(w, tab, a, t0, t1, out, ldo);
}

}  // namespace
}  // namespace torch_lowbit
