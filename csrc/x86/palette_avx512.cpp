// AVX-512 (+ VBMI) paths of the palette kernels (palette.h): 16 codes or TCQ steps per register,
// decoded right after the load and multiplied into fp32 accumulators; weights are read once per
// token block.
//
// Codebook formats: 16 codes per aligned load of the row's 16 interleaved streams, cut out with a
// uniform shift (two where they straddle words). Tables of up to 64 entries per coordinate stay in
// registers (vpermps / vpermi2ps), larger ones are gathered.
// TCQ decode (the dequantize op and the many-token path; the GEMV is palette_avx2_tcq.h's on every
// x86 path): per 16 steps (two tile rows) one vpermi2b (a second register holds the sequence start
// for the tail-biting wrap) and one shift give the states, the hybrid code's hash is a multiply and a
// shift, and one 64-bit gather per tile row fetches (x, y) pairs already in column order. The 1mad
// code computes the values instead (a multiply-add per coordinate, byte sums by vpmaddubsw /
// vpmaddwd with ones), interleaved into column order by a two-source permute per row.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <algorithm>
#include <utility>

#include "common/palette.h"
#include "common/token_blocks.h"

#define TLB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,fma")))

namespace torch_lowbit {
namespace {

constexpr int kMaxTokenBlock = 4;

inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// ---- codebook formats --------------------------------------------------------------------------

inline __mmask64 first_bytes(int64_t n) { return n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1; }

// Codes 16 v .. 16 v + 15 of a row (palette.h: 16 streams), each lane with stream bits above its
// code: the table lookups below ignore them. One aligned load and a shift, or two loads, two shifts
// and an or where the codes straddle a word.
TLB_AVX512 inline __m512i stream_codes(const uint32_t* row, int64_t v, int bits) {
  const int64_t pos = v * bits, w = pos >> 5;
  const int o = static_cast<int>(pos & 31);
  const __m512i a = _mm512_loadu_si512(row + w * kCodeStreams);
  if (o + bits <= 32) return _mm512_srlv_epi32(a, _mm512_set1_epi32(32 - bits - o));
  const __m512i b = _mm512_loadu_si512(row + (w + 1) * kCodeStreams);
  return _mm512_or_si512(_mm512_sllv_epi32(a, _mm512_set1_epi32(o + bits - 32)),
                         _mm512_srlv_epi32(b, _mm512_set1_epi32(64 - o - bits)));
}

// The same for code vector U of a period (32 vectors = B words per stream, starting at `period`),
// B and U compile-time: immediate shifts, no address arithmetic.
template <int B, int U>
TLB_AVX512 __attribute__((always_inline)) inline __m512i period_codes(const uint32_t* period) {
  constexpr int pos = U * B, w = pos >> 5, o = pos & 31;
  const __m512i a = _mm512_loadu_si512(period + w * kCodeStreams);
  if constexpr (o + B <= 32) {
    return _mm512_srli_epi32(a, 32 - B - o);
  } else {
    const __m512i b = _mm512_loadu_si512(period + (w + 1) * kCodeStreams);
    return _mm512_or_si512(_mm512_slli_epi32(a, o + B - 32), _mm512_srli_epi32(b, 64 - o - B));
  }
}

// How a table of 2^b entries (one coordinate) is looked up: in registers up to 64 entries.
enum Lookup { kPerm16 = 0, kPerm32 = 1, kPerm64 = 2, kGather = 3 };

constexpr int lookup_kind(int code_bits) { return code_bits <= 4 ? kPerm16 : code_bits == 5 ? kPerm32 : code_bits == 6 ? kPerm64 : kGather; }

struct PlaneTable {
  __m512 t[4];
  __m512i index_mask;  // 2^b - 1, for gathers
  const float* plane;
};

// Register tables repeat the entries periodically (entry e at every e + k 2^b), so a code with stream
// bits above it still picks its entry: vpermps reads index bits 3..0, vpermi2ps 4..0, the blend bit 5.
TLB_AVX512 inline PlaneTable plane_table(const float* plane, int64_t entries) {
  PlaneTable p;
  p.plane = plane;
  p.index_mask = _mm512_set1_epi32(static_cast<int>(entries - 1));
  alignas(64) float periodic[64];
  for (int e = 0; e < 64; ++e) periodic[e] = plane[e % entries];
  for (int q = 0; q < 4; ++q) p.t[q] = _mm512_load_ps(periodic + 16 * q);
  return p;
}

template <int LK>
TLB_AVX512 inline __m512 lookup(const PlaneTable& p, __m512i code) {
  if constexpr (LK == kPerm16) {
    return _mm512_permutexvar_ps(code, p.t[0]);
  } else if constexpr (LK == kPerm32) {
    return _mm512_permutex2var_ps(p.t[0], code, p.t[1]);
  } else if constexpr (LK == kPerm64) {
    const __m512 low = _mm512_permutex2var_ps(p.t[0], code, p.t[1]);
    const __m512 high = _mm512_permutex2var_ps(p.t[2], code, p.t[3]);
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(code, _mm512_set1_epi32(32)), low, high);
  } else {
    return _mm512_i32gather_ps(_mm512_and_si512(code, p.index_mask), p.plane, 4);
  }
}

// acc[m][c] += table_c[code] * x'-plane c of token m0 + m, 16 codes from j (lanes past `valid` read 0).
template <int MB, int D, int LK>
TLB_AVX512 __attribute__((always_inline)) inline void codebook_fma(__m512 (&acc)[MB][D], const PlaneTable* tab,
                                                                   __m512i code, const float* acts, int64_t M,
                                                                   int64_t m0, int64_t codes, int64_t j,
                                                                   __mmask16 valid) {
  for (int c = 0; c < D; ++c) {
    const __m512 val = lookup<LK>(tab[c], code);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(valid, acts + (c * M + m0 + m) * codes + j);
      acc[m][c] = _mm512_fmadd_ps(val, xv, acc[m][c]);
    }
  }
}

// One period (32 code vectors, 512 codes from j0) into the even / odd accumulators, fully unrolled.
template <int MB, int D, int B, size_t... U>
TLB_AVX512 __attribute__((always_inline)) inline void period_fma(__m512 (&acc0)[MB][D], __m512 (&acc1)[MB][D],
                                                                 const PlaneTable* tab, const uint32_t* period,
                                                                 const float* acts, int64_t M, int64_t m0, int64_t codes,
                                                                 int64_t j0, std::index_sequence<U...>) {
  (codebook_fma<MB, D, lookup_kind(B)>(U % 2 ? acc1 : acc0, tab, period_codes<B, U>(period), acts, M, m0, codes,
                                        j0 + 16 * U, 0xFFFF),
   ...);
}

// Rows [n0, n1) for tokens [m0, m0 + MB): D coordinates per B-bit code. Whole periods run unrolled
// with two sets of accumulators (even and odd code vectors, all indices compile-time so they stay in
// registers); the row's last < 512 codes take the runtime path (masked past the row's end).
template <int MB, int D, int B>
TLB_AVX512 void codebook_rows(const CodebookWeights& w, const float* acts, int64_t M, int64_t m0, int64_t n0,
                              int64_t n1, float* out) {
  constexpr int LK = lookup_kind(B);
  constexpr int64_t kPeriodCodes = 32 * kCodeStreams, kPeriodWords = B * kCodeStreams;
  const int64_t entries = int64_t{1} << B, codes = w.K / D, vectors = (codes + 15) / 16;
  const int64_t periods = codes / kPeriodCodes;
  PlaneTable tab[D];
  for (int c = 0; c < D; ++c) tab[c] = plane_table(w.planes + c * entries, entries);
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* row = w.words + n * w.row_words;
    __m512 acc0[MB][D], acc1[MB][D];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < D; ++c) acc0[m][c] = acc1[m][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < periods; ++p)
      period_fma<MB, D, B>(acc0, acc1, tab, row + p * kPeriodWords, acts, M, m0, codes, p * kPeriodCodes,
                           std::make_index_sequence<32>{});
    for (int64_t v = periods * 32; v < vectors; ++v)
      codebook_fma<MB, D, LK>(acc0, tab, stream_codes(row, v, B), acts, M, m0, codes, 16 * v,
                              first_lanes(codes - 16 * v));
    const float scale = static_cast<float>(w.scales[n]), bias = w.bias ? w.bias[n] : 0.f;
    for (int m = 0; m < MB; ++m) {
      __m512 sum = _mm512_add_ps(acc0[m][0], acc1[m][0]);
      for (int c = 1; c < D; ++c) sum = _mm512_add_ps(sum, _mm512_add_ps(acc0[m][c], acc1[m][c]));
      out[(m0 + m) * w.N + n] = _mm512_reduce_add_ps(sum) * scale + bias;
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
    default: return;  // not reached: codebook_gemv_avx512 checks has_vector_path first
  }
}

bool has_vector_path(const CodebookWeights& w) {
  return w.dim == 1 ? w.code_bits <= 4 : w.code_bits >= 3 && w.code_bits <= 10;
}

template <int D, int LK>
TLB_AVX512 void codebook_decode_rows(const CodebookWeights& w, int64_t n0, int64_t n1, float* dst) {
  const int bits = w.code_bits;
  const int64_t entries = int64_t{1} << bits, codes = w.K / D, vectors = (codes + 15) / 16;
  PlaneTable tab[D];
  for (int c = 0; c < D; ++c) tab[c] = plane_table(w.planes + c * entries, entries);
  const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* words = w.words + n * w.row_words;
    const __m512 scale = _mm512_set1_ps(static_cast<float>(w.scales[n]));
    float* row = dst + (n - n0) * w.K;
    for (int64_t v = 0; v < vectors; ++v) {
      const int64_t j = 16 * v;
      const __m512i code = stream_codes(words, v, bits);
      const __m512 v0 = _mm512_mul_ps(lookup<LK>(tab[0], code), scale);
      if constexpr (D == 1) {
        _mm512_mask_storeu_ps(row + j, first_lanes(codes - j), v0);
      } else {
        const __m512 v1 = _mm512_mul_ps(lookup<LK>(tab[1], code), scale);
        const int64_t left = 2 * (codes - j);  // weights of the row from 2 j on
        _mm512_mask_storeu_ps(row + 2 * j, first_lanes(left), _mm512_permutex2var_ps(v0, even, v1));
        if (left > 16) _mm512_mask_storeu_ps(row + 2 * j + 16, first_lanes(left - 16), _mm512_permutex2var_ps(v0, odd, v1));
      }
    }
  }
}

template <int D>
void codebook_decode_lookup(const CodebookWeights& w, int64_t n0, int64_t n1, float* dst) {
  switch (lookup_kind(w.code_bits)) {
    case kPerm16: return codebook_decode_rows<D, kPerm16>(w, n0, n1, dst);
    case kPerm32: return codebook_decode_rows<D, kPerm32>(w, n0, n1, dst);
    case kPerm64: return codebook_decode_rows<D, kPerm64>(w, n0, n1, dst);
    default: return codebook_decode_rows<D, kGather>(w, n0, n1, dst);
  }
}

// ---- TCQ ---------------------------------------------------------------------------------------

// Lanes of the 8 groups of 16 steps of a sequence (16 s bytes): step 16 i + l starts at bit
// p = (16 i + l) s. Group i loads 64 bytes from the word-aligned byte base[i] (masked at the
// sequence end); vpermi2b fills dword l with stream bytes p/8 .. p/8 + 3 (big-endian), indices >= 64
// picking from the sequence start (the tail-biting wrap), and a right shift by 16 - p%8 leaves the
// state in bits 15..0 (stream bits before it above: the hash below works mod 2^16).
struct TcqLanes {
  alignas(64) int8_t bytes[8][64];
  alignas(64) int32_t shr[8][16];
  int base[8];
  __mmask64 avail[8];
  __mmask64 start;
};

TcqLanes tcq_lanes(int shift) {
  TcqLanes k;
  const int total = 16 * shift;
  k.start = first_bytes(total);
  for (int i = 0; i < 8; ++i) {
    const int base_bit = 16 * i * shift, base = (base_bit >> 3) & ~3;
    k.base[i] = base;
    k.avail[i] = first_bytes(total - base);
    for (int l = 0; l < 16; ++l) {
      const int p = base_bit + l * shift, k0 = p >> 3;
      for (int j = 0; j < 4; ++j) {
        const int m = stream_memory_byte((k0 + 3 - j) % total);
        k.bytes[i][4 * l + j] = static_cast<int8_t>(m >= base ? m - base : 64 + m);
      }
      k.shr[i][l] = 16 - (p & 7);
    }
  }
  return k;
}

// Tile rows 2i and 2i + 1 (steps 16 i .. 16 i + 15) of one sequence, unscaled: `a` is the sequence
// from byte base[i] on, `start` its first bytes. The signed table (palette.h) makes the hybrid code
// one lookup: index = (h >> (15 - Q)) mod 2^(Q+1), bit Q being the sign.
TLB_AVX512 inline __m512i tcq_states(__m512i a, __m512i start, __m512i bytes, __m512i shr) {
  return _mm512_srlv_epi32(_mm512_permutex2var_epi8(a, bytes, start), shr);
}

TLB_AVX512 inline void tcq_row_pair(__m512i a, __m512i start, __m512i bytes, __m512i shr, const long long* table,
                                    __m128i hash_shift, __m512i index_mask, __m512& r0, __m512& r1) {
  const __m512i state = tcq_states(a, start, bytes, shr);
  const __m512i h = _mm512_mullo_epi32(state, _mm512_add_epi32(state, _mm512_set1_epi32(1)));  // mod 2^16 below
  const __m512i index = _mm512_and_si512(_mm512_srl_epi32(h, hash_shift), index_mask);
  r0 = _mm512_castsi512_ps(_mm512_i32gather_epi64(_mm512_castsi512_si256(index), table, 8));
  r1 = _mm512_castsi512_ps(_mm512_i32gather_epi64(_mm512_extracti64x4_epi64(index, 1), table, 8));
}

// The 1mad code's byte sums (palette.h) of 16 states given with stream bits above bit 15.
TLB_AVX512 inline void tcq_mad_sums(__m512i raw_state, __m512i& s0, __m512i& s1) {
  const __m512i state = _mm512_and_si512(raw_state, _mm512_set1_epi32(0xFFFF));
  const __m512i ones8 = _mm512_set1_epi8(1), ones16 = _mm512_set1_epi16(1);
  const __m512i z0 = _mm512_add_epi32(_mm512_mullo_epi32(state, _mm512_set1_epi32(static_cast<int>(kTcqMadMultipliers[0]))),
                                      _mm512_set1_epi32(static_cast<int>(kTcqMadIncrements[0])));
  const __m512i z1 = _mm512_add_epi32(_mm512_mullo_epi32(state, _mm512_set1_epi32(static_cast<int>(kTcqMadMultipliers[1]))),
                                      _mm512_set1_epi32(static_cast<int>(kTcqMadIncrements[1])));
  s0 = _mm512_madd_epi16(_mm512_maddubs_epi16(z0, ones8), ones16);
  s1 = _mm512_madd_epi16(_mm512_maddubs_epi16(z1, ones8), ones16);
}

// Tile rows 2i and 2i + 1 in the 1mad code, unscaled, values in units of 1/128, column order.
TLB_AVX512 inline void tcq_mad_row_pair(__m512i a, __m512i start, __m512i bytes, __m512i shr, __m512& r0, __m512& r1) {
  __m512i s0, s1;
  tcq_mad_sums(tcq_states(a, start, bytes, shr), s0, s1);
  const __m512i offset = _mm512_set1_epi32(kTcqMadOffset);
  const __m512 v0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(s0, offset)), v1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(s1, offset));
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  r0 = _mm512_permutex2var_ps(v0, lo, v1);  // steps 0..7: x0 y0 x1 y1 ..
  r1 = _mm512_permutex2var_ps(v0, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), v1);  // steps 8..15
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

}  // namespace

void codebook_gemv_avx512(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1,
                          float* out) {
  if (!has_vector_path(w)) return codebook_gemv_scalar(w, acts, M, n0, n1, out);
  for_token_blocks<kMaxTokenBlock>(M, [&](auto T, int64_t m0) {
    codebook_rows_for<decltype(T)::value>(w, acts, M, m0, n0, n1, out);
  });
}

void codebook_decode_avx512(const CodebookWeights& w, int64_t n0, int64_t n1, float* dst) {
  if (w.dim == 1) codebook_decode_lookup<1>(w, n0, n1, dst);
  else codebook_decode_lookup<2>(w, n0, n1, dst);
}

TLB_AVX512 void tcq_decode_avx512(const TcqWeights& w, int64_t b0, int64_t b1, float* dst) {
  const bool mad = w.table_bits == kTcqMadTableBits;
  const TcqContext ctx = tcq_context(w);
  const int64_t tiles = w.K / kTcqTile, seq_bytes = 4 * ctx.count;
  const __m512i index_mask = _mm512_set1_epi32((2 << w.table_bits) - 1);
  for (int64_t b = b0; b < b1; ++b) {
    float* band = dst + (b - b0) * kTcqTile * w.K;
    for (int i = 0; i < 8; ++i) {
      const __m512i bytes = _mm512_load_si512(ctx.k.bytes[i]), shr = _mm512_load_si512(ctx.k.shr[i]);
      // 1mad: integer values times scale / 128, the same single rounding as value / 128 times scale
      const float unit = mad ? kTcqMadUnit : 1.f;
      const __m512 s0 = _mm512_set1_ps(static_cast<float>(w.scales[b * kTcqTile + 2 * i]) * unit);
      const __m512 s1 = _mm512_set1_ps(static_cast<float>(w.scales[b * kTcqTile + 2 * i + 1]) * unit);
      const uint8_t* seq = reinterpret_cast<const uint8_t*>(w.words + b * tiles * ctx.count);
      for (int64_t t = 0; t < tiles; ++t, seq += seq_bytes) {
        __m512 r0, r1;
        const __m512i a = _mm512_maskz_loadu_epi8(ctx.k.avail[i], seq + ctx.k.base[i]);
        const __m512i start = _mm512_maskz_loadu_epi8(ctx.k.start, seq);
        if (mad) tcq_mad_row_pair(a, start, bytes, shr, r0, r1);
        else tcq_row_pair(a, start, bytes, shr, ctx.table, ctx.hash_shift, index_mask, r0, r1);
        _mm512_storeu_ps(band + (2 * i) * w.K + t * kTcqTile, _mm512_mul_ps(r0, s0));
        _mm512_storeu_ps(band + (2 * i + 1) * w.K + t * kTcqTile, _mm512_mul_ps(r1, s1));
      }
    }
  }
}

}  // namespace torch_lowbit
#endif
