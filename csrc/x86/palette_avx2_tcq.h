// The AVX2 TCQ GEMV (palette.h's TcqWeights), shared by the translation units that compile it for
// different targets: palette_avx2.cpp (AVX2: the 1mad code's byte sums are vpmaddubsw + vpmaddwd) and
// palette_avxvnni.cpp / palette_avxvnni_evex.cpp (one vpdpbusd per sum, VEX- or EVEX-encoded; the
// same integer sums, so the same results). The including file defines TLB_TCQ_KERNEL, the target
// attribute, first (and TLB_DPBUSD_YMM for the vpdpbusd sums). Everything is in an anonymous
// namespace: each unit's copies are compiled for its own target and never merged with another's.
//
// Tile row r is steps 8 r .. 8 r + 7. Their 16-bit windows lie in at most four consecutive words, so
// one masked 8-word load (the sequence's first word blended in where the tail-biting window wraps),
// two vpermd and a variable shift pair give the states. Rows whose windows all lie in two words
// (tcq2: every row, the last one's second word being word 0) take them as one 64-bit broadcast
// instead: vpshufb puts each window's three bytes in its lane, a variable shift and a mask cut it.
// The hash is a 16-bit multiply; two 64-bit gathers fetch the (x, y) pairs of the row in column order.
// The 1mad code instead computes both coordinates of the 8 states: a 32-bit multiply-add each, then
// the four bytes summed. Its GEMV reads x' reordered per 16-column tile (even columns, then odd ones:
// tcq_split_columns), so the 8 first and 8 second coordinates multiply x' unshuffled, and subtracts
// the byte sums' offset 510 once per row through the token's sum of x'. On Zen 4 the loop is bound
// by the two FP pipes that run both integer multiplies and FMAs (docs/kernels/cpu.md).
#pragma once
#if defined(TORCH_LOWBIT_X86)
#include <cstring>

#include "x86/palette_avx2_codebook.h"

namespace torch_lowbit {
namespace palette_avx2 {
namespace {

// Lane constants of tile row r (steps t = 8 r + l, window at bit p = t s, in words w = p / 32 and
// w + 1, shifted by o = p % 32): the row loads words base[r] .. base[r] + 7 (masked at the sequence
// end, where the wrap lane gets the sequence's first word), vpermd picks w and w + 1 per lane.
struct TcqLanes {
  alignas(32) int32_t first[16][8];   // w - base
  alignas(32) int32_t second[16][8];  // w + 1 - base (the wrap lane when w + 1 is the sequence end)
  alignas(32) int32_t shl[16][8];     // o
  alignas(32) int32_t shr[16][8];     // 32 - o (a shift of 32 gives 0)
  alignas(32) int32_t avail[16][8];   // lanes base + k < count
  alignas(32) int32_t wrap[16][8];    // the lane base + k == count: holds word 0
  // Rows whose windows all lie in words base and base + 1 (two_words; tcq2: every row) read those two
  // words as one 64-bit broadcast instead: lane l takes the three bytes holding its window (MSB first,
  // as a 24-bit value; vpshufb, bytes past the pair zeroed) and shifts it down by 8 - p % 8.
  alignas(32) int8_t pair_bytes[16][32];
  alignas(32) int32_t pair_shift[16][8];
  int base[16];
  bool wraps[16];  // the row's windows read the wrap lane (else the lanes past the sequence go unused)
  bool two_words[16];  // every window of the row lies in words base and base + 1 (tcq2: every row)
  bool second_wraps[16];  // two_words with base + 1 the sequence's end: the second word is word 0 (tcq2: row 15)
};

TcqLanes tcq_lanes(int shift) {
  TcqLanes k;
  const int count = 4 * shift;
  for (int r = 0; r < 16; ++r) {
    const int base = (8 * r * shift) >> 5;
    k.base[r] = base;
    k.wraps[r] = (8 * r + 7) * shift + 16 > 32 * (count - 1);  // the last window reaches word count - 1 + 1
    const bool last_in_base = (((8 * r + 7) * shift) >> 5) == base;
    k.second_wraps[r] = k.wraps[r] && last_in_base && base + 1 == count;
    k.two_words[r] = (!k.wraps[r] && last_in_base) || k.second_wraps[r];
    for (int l = 0; l < 8; ++l) {
      const int p = (8 * r + l) * shift, w = p >> 5;
      k.first[r][l] = w - base;
      k.second[r][l] = w + 1 - base;  // <= 3 + 1: the window spans at most four words
      k.shl[r][l] = p & 31;
      k.shr[r][l] = 32 - (p & 31);
      k.avail[r][l] = base + l < count ? -1 : 0;
      k.wrap[r][l] = base + l == count ? -1 : 0;
      // lane byte i (little-endian) holds the pair's stream byte j + 2 - i; byte 3 and bytes past the pair zero
      const int j = (p - 32 * base) >> 3;
      for (int i = 0; i < 4; ++i) {
        const int byte = j + 2 - i;
        k.pair_bytes[r][(l % 4) * 4 + i + 16 * (l / 4)] =
            i == 3 || byte > 7 ? int8_t(-128) : int8_t(stream_memory_byte(byte));
      }
      k.pair_shift[r][l] = 8 - (p & 7);
    }
  }
  return k;
}

struct TcqContext {
  TcqLanes k;
  const long long* table;
  __m128i hash_shift;
  int count;
};

TcqContext tcq_context(const TcqWeights& w) {
  return {tcq_lanes(w.shift), reinterpret_cast<const long long*>(w.table), _mm_cvtsi32_si128(15 - w.table_bits),
          4 * w.shift};
}

struct TcqRowLanes {
  __m256i first, second, shl, shr, avail, wrap, index_mask, pair_bytes, pair_shift;
  int base;
  bool wraps, two_words, second_wraps;
};

// How a row's sequence words reach the lanes (tcq_row_states).
enum TcqLoad { kMaskedLoad, kPlainLoad, kTwoWords, kTwoWordsWrapped };

TLB_TCQ_KERNEL inline __m256i load_lanes(const int32_t* p) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
}

TLB_TCQ_KERNEL inline TcqRowLanes row_lanes(const TcqContext& ctx, int r, int table_bits) {
  const auto ld = load_lanes;
  return {ld(ctx.k.first[r]), ld(ctx.k.second[r]), ld(ctx.k.shl[r]), ld(ctx.k.shr[r]), ld(ctx.k.avail[r]),
          ld(ctx.k.wrap[r]), _mm256_set1_epi32((2 << table_bits) - 1),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(ctx.k.pair_bytes[r])), ld(ctx.k.pair_shift[r]),
          ctx.k.base[r], ctx.k.wraps[r], ctx.k.two_words[r], ctx.k.second_wraps[r]};
}

// The 16-bit states of tile row r (steps 8 r .. 8 r + 7) of sequence `seq`. kMaskedLoad: any row.
// kPlainLoad: 8 words unmasked, for rows that do not wrap in sequences followed by another one of the
// band (the lanes past the sequence's end then hold the next sequence's words, which no window reads).
// kTwoWords: rows whose windows all lie in words base and base + 1 (one 64-bit broadcast, vpshufb);
// kTwoWordsWrapped: the same with word 0 as the second word (base + 1 is the sequence's end).
template <TcqLoad kLoad = kMaskedLoad>
TLB_TCQ_KERNEL TLB_INLINE __m256i tcq_row_states(const int32_t* seq, const TcqRowLanes& L) {
  if constexpr (kLoad == kTwoWords || kLoad == kTwoWordsWrapped) {
    int64_t pair;
    if constexpr (kLoad == kTwoWords) {
      std::memcpy(&pair, seq + L.base, sizeof(pair));
    } else {
      pair = static_cast<int64_t>(static_cast<uint32_t>(seq[L.base])) | (static_cast<int64_t>(seq[0]) << 32);
    }
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi64x(pair), L.pair_bytes);
    return _mm256_and_si256(_mm256_srlv_epi32(bytes, L.pair_shift), _mm256_set1_epi32(0xFFFF));
  } else {
    __m256i words;
    if constexpr (kLoad == kPlainLoad) {
      words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(seq + L.base));
    } else {
      words = _mm256_maskload_epi32(seq + L.base, L.avail);
      words = _mm256_blendv_epi8(words, _mm256_set1_epi32(seq[0]), L.wrap);
    }
    const __m256i first = _mm256_permutevar8x32_epi32(words, L.first);
    const __m256i second = _mm256_permutevar8x32_epi32(words, L.second);
    const __m256i hi = _mm256_sllv_epi32(first, L.shl), lo = _mm256_srlv_epi32(second, L.shr);
    return _mm256_srli_epi32(_mm256_or_si256(hi, lo), 16);
  }
}

// The 1mad code of 8 states: bytesum((A_c state + B_c) mod 2^32) per lane, coordinate c = 0 in s0,
// 1 in s1 (the value is (sum - 510) / 128, palette.h).
TLB_TCQ_KERNEL TLB_INLINE void tcq_mad_sums(__m256i state, __m256i& s0, __m256i& s1) {
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  const __m256i z0 = _mm256_add_epi32(_mm256_mullo_epi32(state, _mm256_set1_epi32(static_cast<int>(kTcqMadMultipliers[0]))),
                                      _mm256_set1_epi32(static_cast<int>(kTcqMadIncrements[0])));
  const __m256i z1 = _mm256_add_epi32(_mm256_mullo_epi32(state, _mm256_set1_epi32(static_cast<int>(kTcqMadMultipliers[1]))),
                                      _mm256_set1_epi32(static_cast<int>(kTcqMadIncrements[1])));
#if defined(TLB_DPBUSD_YMM)
  (void)ones16;  // one vpdpbusd per sum: the 4 bytes (unsigned) times 1, added
  s0 = TLB_DPBUSD_YMM(_mm256_setzero_si256(), z0, ones8);
  s1 = TLB_DPBUSD_YMM(_mm256_setzero_si256(), z1, ones8);
#else
  s0 = _mm256_madd_epi16(_mm256_maddubs_epi16(z0, ones8), ones16);  // bytes (unsigned) times 1, pairs summed
  s1 = _mm256_madd_epi16(_mm256_maddubs_epi16(z1, ones8), ones16);
#endif
}

// Tile row r of sequence `seq`, unscaled: columns 0-7 in c0, 8-15 in c1. The signed table (palette.h)
// makes the hybrid code one lookup: index = (h >> (15 - Q)) mod 2^(Q+1), bit Q being the sign. The
// 1mad code's values are left in units of 1/128 (as integers; callers fold the unit into the scale).
template <bool kMad, TcqLoad kLoad = kMaskedLoad>
TLB_TCQ_KERNEL TLB_INLINE void tcq_row(const int32_t* seq, const TcqRowLanes& L, const long long* table,
                                       __m128i hash_shift, __m256& c0, __m256& c1) {
  const __m256i state = tcq_row_states<kLoad>(seq, L);
  if constexpr (kMad) {
    __m256i s0, s1;
    tcq_mad_sums(state, s0, s1);
    const __m256i offset = _mm256_set1_epi32(kTcqMadOffset);
    const __m256 v0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(s0, offset));
    const __m256 v1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(s1, offset));
    const __m256 lo = _mm256_unpacklo_ps(v0, v1), hi = _mm256_unpackhi_ps(v0, v1);  // steps 0,1,4,5 | 2,3,6,7
    c0 = _mm256_permute2f128_ps(lo, hi, 0x20);
    c1 = _mm256_permute2f128_ps(lo, hi, 0x31);
    return;
  }
  // state (state + 1) mod 2^16 in 16-bit lanes: the high halves multiply 0 by 0 or 1
  const __m256i h = _mm256_mullo_epi16(state, _mm256_add_epi32(state, _mm256_set1_epi32(1)));
  const __m256i index = _mm256_and_si256(_mm256_srl_epi32(h, hash_shift), L.index_mask);
  c0 = _mm256_castsi256_ps(_mm256_i32gather_epi64(table, _mm256_castsi256_si128(index), 8));
  c1 = _mm256_castsi256_ps(_mm256_i32gather_epi64(table, _mm256_extracti128_si256(index, 1), 8));
}

// Band b for tokens [m0, m0 + MB): chunks of kTcqChunkTiles tiles, each one tile row at a time (a
// chunk's codes and x' stay in L1 across its 16 rows; each row's partial sums wait in `rows`). Each
// chunk's row r prefetches a 1/16 of the next band's codes into L2 for the rows of the next band.
// The 1mad code (kMad): x holds each tile's even columns then its odd ones (tcq_split_columns), x_sums
// each token's sum of x'.
constexpr int64_t kTcqChunkTiles = 128;

template <int MB, bool kMad>
TLB_TCQ_KERNEL void tcq_band(const TcqWeights& w, const TcqContext& ctx, const float* x, const float* x_sums,
                             int64_t m0, int64_t b, float* out) {
  const int64_t tiles = w.K / kTcqTile;
  const int32_t* band = reinterpret_cast<const int32_t*>(w.words + b * tiles * ctx.count);
  const char* next_band = b + 1 < w.N / kTcqTile ? reinterpret_cast<const char*>(band + tiles * ctx.count) : nullptr;
  const int64_t tile_bytes = 4 * ctx.count;
  __m256 rows[kTcqTile][MB];
  for (int r = 0; r < kTcqTile; ++r)
    for (int m = 0; m < MB; ++m) rows[r][m] = _mm256_setzero_ps();
  for (int64_t chunk = 0; chunk < tiles; chunk += kTcqChunkTiles) {
    const int64_t chunk_end = std::min(tiles, chunk + kTcqChunkTiles);
    for (int r = 0; r < kTcqTile; ++r) {
      if (next_band) {
        const int64_t from = chunk + r * kTcqChunkTiles / kTcqTile, to = chunk + (r + 1) * kTcqChunkTiles / kTcqTile;
        for (int64_t byte = from * tile_bytes; byte < std::min(to, tiles) * tile_bytes; byte += 64)
          _mm_prefetch(next_band + byte, _MM_HINT_T1);
      }
      const TcqRowLanes L = row_lanes(ctx, r, w.table_bits);
      __m256 acc0[MB], acc1[MB];
      for (int m = 0; m < MB; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
      const auto tiles_from = [&](auto load, int64_t t0, int64_t t1) TLB_TCQ_KERNEL {
        constexpr TcqLoad kLoad = decltype(load)::value;
        const int32_t* seq = band + t0 * ctx.count;
        const float* xt = x + m0 * w.K + t0 * kTcqTile;
        int64_t t = t0;
        if constexpr (MB == 1 && kMad) {  // one token: tile pairs with a second accumulator pair (FMA latency)
          __m256 odd0 = _mm256_setzero_ps(), odd1 = _mm256_setzero_ps();
          for (; t + 2 <= t1; t += 2, seq += 2 * ctx.count, xt += 2 * kTcqTile) {
            __m256i s0, s1, s2, s3;
            tcq_mad_sums(tcq_row_states<kLoad>(seq, L), s0, s1);
            tcq_mad_sums(tcq_row_states<kLoad>(seq + ctx.count, L), s2, s3);
            acc0[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_loadu_ps(xt), acc0[0]);
            acc1[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_loadu_ps(xt + 8), acc1[0]);
            odd0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), _mm256_loadu_ps(xt + kTcqTile), odd0);
            odd1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s3), _mm256_loadu_ps(xt + kTcqTile + 8), odd1);
          }
          acc0[0] = _mm256_add_ps(acc0[0], odd0);
          acc1[0] = _mm256_add_ps(acc1[0], odd1);
        }
        for (; t < t1; ++t, seq += ctx.count, xt += kTcqTile) {
          __m256 c0, c1;
          if constexpr (kMad) {  // byte sums, offset not subtracted: first coordinates, then second ones
            __m256i s0, s1;
            tcq_mad_sums(tcq_row_states<kLoad>(seq, L), s0, s1);
            c0 = _mm256_cvtepi32_ps(s0);
            c1 = _mm256_cvtepi32_ps(s1);
          } else {
            tcq_row<false, kLoad>(seq, L, ctx.table, ctx.hash_shift, c0, c1);
          }
          for (int m = 0; m < MB; ++m) {
            acc0[m] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(xt + m * w.K), acc0[m]);
            acc1[m] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xt + m * w.K + 8), acc1[m]);
          }
        }
      };
      if (L.second_wraps) {
        tiles_from(std::integral_constant<TcqLoad, kTwoWordsWrapped>{}, chunk, chunk_end);
      } else if (L.two_words) {
        tiles_from(std::integral_constant<TcqLoad, kTwoWords>{}, chunk, chunk_end);
      } else {  // the band's last sequence may end the tensor: masked loads there
        const int64_t plain_end = std::clamp(L.wraps ? int64_t{0} : tiles - 1, chunk, chunk_end);
        tiles_from(std::integral_constant<TcqLoad, kPlainLoad>{}, chunk, plain_end);
        tiles_from(std::integral_constant<TcqLoad, kMaskedLoad>{}, plain_end, chunk_end);
      }
      for (int m = 0; m < MB; ++m) rows[r][m] = _mm256_add_ps(rows[r][m], _mm256_add_ps(acc0[m], acc1[m]));
    }
  }
  for (int r = 0; r < kTcqTile; ++r) {
    const int64_t n = b * kTcqTile + r;
    const float scale = static_cast<float>(w.scales[n]), bias = w.bias ? w.bias[n] : 0.f;
    for (int m = 0; m < MB; ++m) {
      const float dot = horizontal_sum(rows[r][m]);
      out[(m0 + m) * w.N + n] = kMad ? (dot - kTcqMadOffset * x_sums[m0 + m]) * (scale * kTcqMadUnit) + bias
                                     : dot * scale + bias;
    }
  }
}

// The GEMV over bands [b0, b1) (TcqGemvFn); each unit's entry point calls it.
TLB_TCQ_KERNEL void tcq_gemv_kernel(const TcqWeights& w, const float* x, int64_t M, int64_t b0, int64_t b1, float* out) {
  const TcqContext ctx = tcq_context(w);
  tcq_gemv_bands<kMaxTokenBlock>(w, x, M, b0, b1, [&](auto T, auto mad, const float* xs, const float* sums, int64_t m0,
                                                    int64_t b) {
    tcq_band<decltype(T)::value, decltype(mad)::value>(w, ctx, xs, sums, m0, b, out);
  });
}

}  // namespace
}  // namespace palette_avx2
}  // namespace torch_lowbit
#endif
