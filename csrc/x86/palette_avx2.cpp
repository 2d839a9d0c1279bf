// AVX2 paths of the palette kernels (palette.h): the plan of the AVX-512 kernels (palette_avx512.cpp)
// in 8-lane halves, for the CPUs without AVX-512 (and AVX-512 without VBMI). Decoding is the scalar
// path's arithmetic (one table read, one multiply by the row scale), so the dequantize ops are bit
// for bit the scalar ones; the fused GEMVs differ from scalar only in the order of the fp32 sums.
//
// Codebook formats: code vector v (codes 16 v .. 16 v + 15) is two aligned 8-word loads (streams
// 0-7 and 8-15) cut with a uniform shift. Tables of up to 32 entries per coordinate stay in
// registers: vpermps reads index bits 2..0 and blends on bits 3 and 4 pick among 8-entry quarters;
// larger tables are gathered (vgatherdps).
// TCQ: tile row r is steps 8 r .. 8 r + 7. Their 16-bit windows lie in at most four consecutive
// words, so one masked 8-word load (the sequence's first word blended in where the tail-biting
// window wraps), two vpermd and a variable shift pair give the states; the hash is a 16-bit
// multiply; two 64-bit gathers fetch the (x, y) pairs of the row in column order.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <algorithm>
#include <utility>

#include "common/palette.h"
#include "common/token_blocks.h"

#define TLB_AVX2 __attribute__((target("avx2,fma")))
#define TLB_INLINE __attribute__((always_inline)) inline

namespace torch_lowbit {
namespace {

constexpr int kMaxTokenBlock = 4;

// All-ones in lanes [0, n), for maskload / maskstore.
TLB_AVX2 inline __m256i first_lanes(int64_t n) {
  const int k = static_cast<int>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

TLB_AVX2 inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// ---- codebook formats --------------------------------------------------------------------------

// Codes 16 v + 8 h .. 16 v + 8 h + 7 of a row (streams 8 h .. 8 h + 7), stream bits above each code.
TLB_AVX2 inline __m256i stream_codes(const uint32_t* row, int64_t v, int h, int bits) {
  const int64_t pos = v * bits, w = pos >> 5;
  const int o = static_cast<int>(pos & 31);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + w * kCodeStreams + 8 * h));
  if (o + bits <= 32) return _mm256_srl_epi32(a, _mm_cvtsi32_si128(32 - bits - o));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (w + 1) * kCodeStreams + 8 * h));
  return _mm256_or_si256(_mm256_sll_epi32(a, _mm_cvtsi32_si128(o + bits - 32)),
                         _mm256_srl_epi32(b, _mm_cvtsi32_si128(64 - o - bits)));
}

// The same for code vector U, half H of a period (32 code vectors = B words per stream), all
// compile-time: immediate shifts, no address arithmetic.
template <int B, int U, int H>
TLB_AVX2 TLB_INLINE __m256i period_codes(const uint32_t* period) {
  constexpr int pos = U * B, w = pos >> 5, o = pos & 31;
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(period + w * kCodeStreams + 8 * H));
  if constexpr (o + B <= 32) {
    return _mm256_srli_epi32(a, 32 - B - o);
  } else {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(period + (w + 1) * kCodeStreams + 8 * H));
    return _mm256_or_si256(_mm256_slli_epi32(a, o + B - 32), _mm256_srli_epi32(b, 64 - o - B));
  }
}

enum Lookup { kPerm8 = 0, kPerm16 = 1, kPerm32 = 2, kGather = 3 };

constexpr int lookup_kind(int code_bits) {
  return code_bits <= 3 ? kPerm8 : code_bits == 4 ? kPerm16 : kGather;
}

struct PlaneTable {
  __m256 t[4];  // entries repeated with period 2^b: a code with stream bits above it finds its entry
  __m256i index_mask;
  const float* plane;
};

TLB_AVX2 inline PlaneTable plane_table(const float* plane, int64_t entries) {
  PlaneTable p;
  p.plane = plane;
  p.index_mask = _mm256_set1_epi32(static_cast<int>(entries - 1));
  alignas(32) float periodic[32];
  for (int e = 0; e < 32; ++e) periodic[e] = plane[e % entries];
  for (int q = 0; q < 4; ++q) p.t[q] = _mm256_load_ps(periodic + 8 * q);
  return p;
}

// vblendvps selects on the sign bit: move code bit `bit` there.
template <int bit>
TLB_AVX2 TLB_INLINE __m256 select_on(__m256i code, __m256 zero, __m256 one) {
  return _mm256_blendv_ps(zero, one, _mm256_castsi256_ps(_mm256_slli_epi32(code, 31 - bit)));
}

template <int LK>
TLB_AVX2 TLB_INLINE __m256 lookup(const PlaneTable& p, __m256i code) {
  if constexpr (LK == kPerm8) {
    return _mm256_permutevar8x32_ps(p.t[0], code);
  } else if constexpr (LK == kPerm16) {
    return select_on<3>(code, _mm256_permutevar8x32_ps(p.t[0], code), _mm256_permutevar8x32_ps(p.t[1], code));
  } else if constexpr (LK == kPerm32) {
    const __m256 low = select_on<3>(code, _mm256_permutevar8x32_ps(p.t[0], code), _mm256_permutevar8x32_ps(p.t[1], code));
    const __m256 high = select_on<3>(code, _mm256_permutevar8x32_ps(p.t[2], code), _mm256_permutevar8x32_ps(p.t[3], code));
    return select_on<4>(code, low, high);
  } else {
    return _mm256_i32gather_ps(p.plane, _mm256_and_si256(code, p.index_mask), 4);
  }
}

// Independent accumulator sets: a single token needs more FMA chains than tokens x coordinates give.
template <int MB, int D>
constexpr int kAccSets = MB * D <= 4 ? 2 : 1;

// acc[m][c] += table_c[code] * x'-plane c of token m0 + m, 8 codes from j (lanes where `valid` is 0
// read no activation and add 0).
template <int MB, int D, int LK, bool kMasked>
TLB_AVX2 TLB_INLINE void codebook_fma(__m256 (&acc)[MB][D], const PlaneTable* tab, __m256i code, const float* acts,
                                      int64_t M, int64_t m0, int64_t codes, int64_t j, __m256i valid) {
  for (int c = 0; c < D; ++c) {
    const __m256 val = lookup<LK>(tab[c], code);
    for (int m = 0; m < MB; ++m) {
      const float* xp = acts + (c * M + m0 + m) * codes + j;
      const __m256 xv = kMasked ? _mm256_maskload_ps(xp, valid) : _mm256_loadu_ps(xp);
      acc[m][c] = _mm256_fmadd_ps(val, xv, acc[m][c]);
    }
  }
}

// One period (32 code vectors, 512 codes from j0), fully unrolled; the halves alternate sets.
template <int MB, int D, int B, size_t... U>
TLB_AVX2 TLB_INLINE void period_fma(__m256 (&acc)[kAccSets<MB, D>][MB][D], const PlaneTable* tab,
                                    const uint32_t* period, const float* acts, int64_t M, int64_t m0, int64_t codes,
                                    int64_t j0, std::index_sequence<U...>) {
  constexpr int LK = lookup_kind(B), last = kAccSets<MB, D> - 1;
  const __m256i all = _mm256_set1_epi32(-1);
  ((codebook_fma<MB, D, LK, false>(acc[0], tab, period_codes<B, U, 0>(period), acts, M, m0, codes, j0 + 16 * U, all),
    codebook_fma<MB, D, LK, false>(acc[last], tab, period_codes<B, U, 1>(period), acts, M, m0, codes,
                                   j0 + 16 * U + 8, all)),
   ...);
}

// Rows [n0, n1) for tokens [m0, m0 + MB): whole periods unrolled, the row's last < 512 codes at
// run time (masked past the row's end).
template <int MB, int D, int B>
TLB_AVX2 void codebook_rows(const CodebookWeights& w, const float* acts, int64_t M, int64_t m0, int64_t n0, int64_t n1,
                            float* out) {
  constexpr int LK = lookup_kind(B), kSets = kAccSets<MB, D>;
  constexpr int64_t kPeriodCodes = 32 * kCodeStreams, kPeriodWords = B * kCodeStreams;
  const int64_t entries = int64_t{1} << B, codes = w.K / D, vectors = (codes + 15) / 16;
  const int64_t periods = codes / kPeriodCodes;
  PlaneTable tab[D];
  for (int c = 0; c < D; ++c) tab[c] = plane_table(w.planes + c * entries, entries);
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* row = w.words + n * w.row_words;
    __m256 acc[kSets][MB][D];
    for (int s = 0; s < kSets; ++s)
      for (int m = 0; m < MB; ++m)
        for (int c = 0; c < D; ++c) acc[s][m][c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < periods; ++p)
      period_fma<MB, D, B>(acc, tab, row + p * kPeriodWords, acts, M, m0, codes, p * kPeriodCodes,
                           std::make_index_sequence<32>{});
    for (int64_t v = periods * 32; v < vectors; ++v)
      for (int h = 0; h < 2; ++h) {
        const int64_t j = 16 * v + 8 * h;
        if (j < codes)
          codebook_fma<MB, D, LK, true>(acc[0], tab, stream_codes(row, v, h, B), acts, M, m0, codes, j,
                                        first_lanes(codes - j));
      }
    const float scale = static_cast<float>(w.scales[n]), bias = w.bias ? w.bias[n] : 0.f;
    for (int m = 0; m < MB; ++m) {
      __m256 sum = acc[0][m][0];
      for (int s = 0; s < kSets; ++s)
        for (int c = 0; c < D; ++c)
          if (s + c > 0) sum = _mm256_add_ps(sum, acc[s][m][c]);
      out[(m0 + m) * w.N + n] = horizontal_sum(sum) * scale + bias;
    }
  }
}

template <int MB>
void codebook_rows_for(const CodebookWeights& w, const float* acts, int64_t M, int64_t m0, int64_t n0, int64_t n1,
                       float* out) {
  switch (w.dim * 16 + w.code_bits) {  // nuq: 1 weight per code, 1..4 bits; vq: 2 per code, 3..10 bits
#define TLB_CODEBOOK_CASE(D, B) \
  case D * 16 + B: return codebook_rows<MB, D, B>(w, acts, M, m0, n0, n1, out);
    TLB_CODEBOOK_CASE(1, 1) TLB_CODEBOOK_CASE(1, 2) TLB_CODEBOOK_CASE(1, 3) TLB_CODEBOOK_CASE(1, 4)
    TLB_CODEBOOK_CASE(2, 3) TLB_CODEBOOK_CASE(2, 4) TLB_CODEBOOK_CASE(2, 5) TLB_CODEBOOK_CASE(2, 6)
    TLB_CODEBOOK_CASE(2, 7) TLB_CODEBOOK_CASE(2, 8) TLB_CODEBOOK_CASE(2, 9) TLB_CODEBOOK_CASE(2, 10)
#undef TLB_CODEBOOK_CASE
    default: return;  // not reached: codebook_gemv_avx2 checks has_vector_path first
  }
}

bool has_vector_path(const CodebookWeights& w) {
  return w.dim == 1 ? w.code_bits <= 4 : w.code_bits >= 3 && w.code_bits <= 10;
}

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

// ---- TCQ ---------------------------------------------------------------------------------------

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
  int base[16];
};

TcqLanes tcq_lanes(int shift) {
  TcqLanes k;
  const int count = 4 * shift;
  for (int r = 0; r < 16; ++r) {
    const int base = (8 * r * shift) >> 5;
    k.base[r] = base;
    for (int l = 0; l < 8; ++l) {
      const int p = (8 * r + l) * shift, w = p >> 5;
      k.first[r][l] = w - base;
      k.second[r][l] = w + 1 - base;  // <= 3 + 1: the window spans at most four words
      k.shl[r][l] = p & 31;
      k.shr[r][l] = 32 - (p & 31);
      k.avail[r][l] = base + l < count ? -1 : 0;
      k.wrap[r][l] = base + l == count ? -1 : 0;
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
  __m256i first, second, shl, shr, avail, wrap, index_mask;
  int base;
};

TLB_AVX2 inline __m256i load_lanes(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }

TLB_AVX2 inline TcqRowLanes row_lanes(const TcqContext& ctx, int r, int table_bits) {
  const auto ld = load_lanes;
  return {ld(ctx.k.first[r]), ld(ctx.k.second[r]), ld(ctx.k.shl[r]), ld(ctx.k.shr[r]), ld(ctx.k.avail[r]),
          ld(ctx.k.wrap[r]), _mm256_set1_epi32((2 << table_bits) - 1), ctx.k.base[r]};
}

// Tile row r of sequence `seq`, unscaled: columns 0-7 in c0, 8-15 in c1. The signed table (palette.h)
// makes the hybrid code one lookup: index = (h >> (15 - Q)) mod 2^(Q+1), bit Q being the sign.
TLB_AVX2 TLB_INLINE void tcq_row(const int32_t* seq, const TcqRowLanes& L, const long long* table, __m128i hash_shift,
                                 __m256& c0, __m256& c1) {
  __m256i words = _mm256_maskload_epi32(seq + L.base, L.avail);
  words = _mm256_blendv_epi8(words, _mm256_set1_epi32(seq[0]), L.wrap);
  const __m256i hi = _mm256_sllv_epi32(_mm256_permutevar8x32_epi32(words, L.first), L.shl);
  const __m256i lo = _mm256_srlv_epi32(_mm256_permutevar8x32_epi32(words, L.second), L.shr);
  const __m256i state = _mm256_srli_epi32(_mm256_or_si256(hi, lo), 16);
  // state (state + 1) mod 2^16 in 16-bit lanes: the high halves multiply 0 by 0 or 1
  const __m256i h = _mm256_mullo_epi16(state, _mm256_add_epi32(state, _mm256_set1_epi32(1)));
  const __m256i index = _mm256_and_si256(_mm256_srl_epi32(h, hash_shift), L.index_mask);
  c0 = _mm256_castsi256_ps(_mm256_i32gather_epi64(table, _mm256_castsi256_si128(index), 8));
  c1 = _mm256_castsi256_ps(_mm256_i32gather_epi64(table, _mm256_extracti128_si256(index, 1), 8));
}

// Band b for tokens [m0, m0 + MB), one tile row at a time over all tiles (the band's codes are
// re-read from L1/L2 per row, from DRAM once).
template <int MB>
TLB_AVX2 void tcq_band(const TcqWeights& w, const TcqContext& ctx, const float* x, int64_t m0, int64_t b, float* out) {
  const int64_t tiles = w.K / kTcqTile;
  const int32_t* band = reinterpret_cast<const int32_t*>(w.words + b * tiles * ctx.count);
  for (int r = 0; r < kTcqTile; ++r) {
    const TcqRowLanes L = row_lanes(ctx, r, w.table_bits);
    __m256 acc0[MB], acc1[MB];
    for (int m = 0; m < MB; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
    const int32_t* seq = band;
    const float* xt = x + m0 * w.K;
    for (int64_t t = 0; t < tiles; ++t, seq += ctx.count, xt += kTcqTile) {
      __m256 c0, c1;
      tcq_row(seq, L, ctx.table, ctx.hash_shift, c0, c1);
      for (int m = 0; m < MB; ++m) {
        acc0[m] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(xt + m * w.K), acc0[m]);
        acc1[m] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xt + m * w.K + 8), acc1[m]);
      }
    }
    const int64_t n = b * kTcqTile + r;
    const float scale = static_cast<float>(w.scales[n]), bias = w.bias ? w.bias[n] : 0.f;
    for (int m = 0; m < MB; ++m) out[(m0 + m) * w.N + n] = horizontal_sum(_mm256_add_ps(acc0[m], acc1[m])) * scale + bias;
  }
}

}  // namespace

void codebook_gemv_avx2(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1, float* out) {
  if (!has_vector_path(w)) return codebook_gemv_scalar(w, acts, M, n0, n1, out);
  for_token_blocks<kMaxTokenBlock>(M, [&](auto T, int64_t m0) {
    codebook_rows_for<decltype(T)::value>(w, acts, M, m0, n0, n1, out);
  });
}

void codebook_decode_avx2(const CodebookWeights& w, int64_t n0, int64_t n1, float* dst) {
  if (w.dim == 1) codebook_decode_lookup<1>(w, n0, n1, dst);
  else codebook_decode_lookup<2>(w, n0, n1, dst);
}

void tcq_gemv_avx2(const TcqWeights& w, const float* x, int64_t M, int64_t b0, int64_t b1, float* out) {
  const TcqContext ctx = tcq_context(w);
  for (int64_t b = b0; b < b1; ++b)
    for_token_blocks<kMaxTokenBlock>(M, [&](auto T, int64_t m0) { tcq_band<decltype(T)::value>(w, ctx, x, m0, b, out); });
}

TLB_AVX2 void tcq_decode_avx2(const TcqWeights& w, int64_t b0, int64_t b1, float* dst) {
  const TcqContext ctx = tcq_context(w);
  const int64_t tiles = w.K / kTcqTile;
  for (int64_t b = b0; b < b1; ++b) {
    float* band = dst + (b - b0) * kTcqTile * w.K;
    const int32_t* first_seq = reinterpret_cast<const int32_t*>(w.words + b * tiles * ctx.count);
    for (int r = 0; r < kTcqTile; ++r) {
      const TcqRowLanes L = row_lanes(ctx, r, w.table_bits);
      const __m256 scale = _mm256_set1_ps(static_cast<float>(w.scales[b * kTcqTile + r]));
      const int32_t* seq = first_seq;
      for (int64_t t = 0; t < tiles; ++t, seq += ctx.count) {
        __m256 c0, c1;
        tcq_row(seq, L, ctx.table, ctx.hash_shift, c0, c1);
        _mm256_storeu_ps(band + r * w.K + t * kTcqTile, _mm256_mul_ps(c0, scale));
        _mm256_storeu_ps(band + r * w.K + t * kTcqTile + 8, _mm256_mul_ps(c1, scale));
      }
    }
  }
}

}  // namespace torch_lowbit
#endif
