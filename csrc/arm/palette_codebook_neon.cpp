// NEON paths of the codebook kernels (palette.h: nuq / vq in palette_packed, 1-12-bit codes, 1 or 2
// weights per code).
//
// Code vector v (codes 16 v .. 16 v + 15) is four 4-word loads (streams 0-3, 4-7, 8-11, 12-15) at
// the same row word, cut with uniform shifts: ushl left by the bit offset, the next word's bits
// or-ed in with a negative ushl where the code crosses into it, ushl right down to the bottom.
// Planes of up to 16 entries (b <= 4: nuq1-4, vq1.5, vq2) stay in registers: 64 bytes, one 4-register
// tbl per 4 codes on byte indices 4 code + 0..3 (one mla: code * 0x04040404 + 0x03020100). Larger
// tables are read with one load per lane (NEON has no gather); 2-D ones from an interleaved copy,
// one 64-bit load per code. Decoding is the scalar path's arithmetic (one table read, one multiply by
// the row scale): bit for bit codebook_decode_scalar. The GEMV FMAs in fp32 vectors (per-token and
// per-plane accumulators, 2-4 independent sets while few tokens give few chains) and differs from
// scalar only in the order of the sums; bias is added after the scale, as there.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "arm/palette_neon.h"
#include "common/palette.h"
#include "common/token_blocks.h"

namespace torch_lowbit {
namespace palette_neon {
namespace {

constexpr int kRegisterEntries = 16;  // a 64-byte tbl table: 16 fp32 entries per plane

enum CodebookLookup { kRegisterTable, kLaneLoads };

struct CodebookTables {
  uint8x16x4_t planes[2];    // kRegisterTable: plane c's entries as bytes (zero past 2^b)
  const float* entries;      // kLaneLoads: plane 0 (d = 1) or the interleaved pairs (d = 2)
  std::vector<float> pairs;  // kLaneLoads, d = 2: entry e's (x, y) at 2 e, 2 e + 1
};

CodebookTables codebook_tables(const CodebookWeights& w) {
  CodebookTables t;
  const int64_t entries = int64_t{1} << w.code_bits;
  if (entries <= kRegisterEntries) {
    for (int c = 0; c < w.dim; ++c) {
      float plane[kRegisterEntries] = {};
      std::copy(w.planes + c * entries, w.planes + (c + 1) * entries, plane);
      t.planes[c] = vld1q_u8_x4(reinterpret_cast<const uint8_t*>(plane));
    }
    t.entries = nullptr;
  } else if (w.dim == 1) {
    t.entries = w.planes;
  } else {
    t.pairs.resize(2 * entries);
    for (int64_t e = 0; e < entries; ++e) {
      t.pairs[2 * e] = w.planes[e];
      t.pairs[2 * e + 1] = w.planes[entries + e];
    }
    t.entries = t.pairs.data();
  }
  return t;
}

// Codes 16 v .. 16 v + 15 of a row: streams 4 q .. 4 q + 3 in codes[q]. The left shift by the offset
// o puts the code at the top (NEON shifts by a register count; a count of 32 or more gives 0).
inline void code_vector(const uint32_t* row, int64_t v, int bits, uint32x4_t (&codes)[4]) {
  const int64_t pos = v * bits;
  const int o = static_cast<int>(pos & 31);
  const uint32_t* word = row + (pos >> 5) * kCodeStreams;
  const int32x4_t up = vdupq_n_s32(o), down = vdupq_n_s32(bits - 32);
  if (o + bits <= 32) {
#pragma GCC unroll 8
    for (int q = 0; q < 4; ++q) codes[q] = vshlq_u32(vshlq_u32(vld1q_u32(word + 4 * q), up), down);
    return;
  }
  const int32x4_t rest = vdupq_n_s32(o - 32);  // the stream's next word (row word + 16) fills the low bits
#pragma GCC unroll 8
  for (int q = 0; q < 4; ++q) {
    const uint32x4_t high = vshlq_u32(vld1q_u32(word + 4 * q), up);
    const uint32x4_t low = vshlq_u32(vld1q_u32(word + kCodeStreams + 4 * q), rest);
    codes[q] = vshlq_u32(vorrq_u32(high, low), down);
  }
}

// tbl byte indices of 4 codes: lane bytes 4 code + 0, 1, 2, 3 (the fp32 entry's bytes).
inline uint8x16_t entry_bytes(uint32x4_t code) {
  return vreinterpretq_u8_u32(vmlaq_u32(vdupq_n_u32(0x03020100u), code, vdupq_n_u32(0x04040404u)));
}

inline float32x4_t register_lookup(const uint8x16x4_t& plane, uint8x16_t bytes) {
  return vreinterpretq_f32_u8(vqtbl4q_u8(plane, bytes));
}

inline float32x4_t load_entries(const float* plane, uint32x4_t code) {
  float32x4_t v = vld1q_dup_f32(plane + vgetq_lane_u32(code, 0));
  v = vld1q_lane_f32(plane + vgetq_lane_u32(code, 1), v, 1);
  v = vld1q_lane_f32(plane + vgetq_lane_u32(code, 2), v, 2);
  return vld1q_lane_f32(plane + vgetq_lane_u32(code, 3), v, 3);
}

// The entries of 4 codes per plane (the GEMV's order: x' comes split into planes).
template <int D, CodebookLookup LK>
inline void plane_values(const CodebookTables& t, uint32x4_t code, float32x4_t (&val)[D]) {
  if constexpr (LK == kRegisterTable) {
    const uint8x16_t bytes = entry_bytes(code);
#pragma GCC unroll 8
    for (int c = 0; c < D; ++c) val[c] = register_lookup(t.planes[c], bytes);
  } else if constexpr (D == 1) {
    val[0] = load_entries(t.entries, code);
  } else {
    float32x4_t first, second;
    load_pairs(t.entries, code, first, second);
    val[0] = vuzp1q_f32(first, second);
    val[1] = vuzp2q_f32(first, second);
  }
}

// The weights of 4 codes in row order (d = 2: x y x y in out[0], out[1]).
template <int D, CodebookLookup LK>
inline void row_values(const CodebookTables& t, uint32x4_t code, float32x4_t (&out)[D]) {
  if constexpr (D == 2 && LK == kLaneLoads) {
    load_pairs(t.entries, code, out[0], out[1]);
  } else {
    plane_values<D, LK>(t, code, out);
    if constexpr (D == 2) {
      const float32x4_t x = out[0], y = out[1];
      out[0] = vzip1q_f32(x, y);
      out[1] = vzip2q_f32(x, y);
    }
  }
}

// Independent accumulator sets (code quarter q adds into set q % kSets): one token of a 1-D table
// gives a single FMA chain per vector otherwise.
template <int MB, int D>
constexpr int kAccSets = MB * D == 1 ? 4 : MB * D <= 4 ? 2 : 1;

// acc += the 16 codes' entries times x': plane c of token m at x + c plane_stride + m token_stride.
template <int MB, int D, CodebookLookup LK>
inline void fma_vector(float32x4_t (&acc)[kAccSets<MB, D>][MB][D], const CodebookTables& t,
                       const uint32x4_t (&codes)[4], const float* x, int64_t plane_stride, int64_t token_stride) {
#pragma GCC unroll 8
  for (int q = 0; q < 4; ++q) {
    float32x4_t val[D];
    plane_values<D, LK>(t, codes[q], val);
#pragma GCC unroll 8
    for (int c = 0; c < D; ++c)
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        float32x4_t& a = acc[q % kAccSets<MB, D>][m][c];
        a = vfmaq_f32(a, val[c], vld1q_f32(x + c * plane_stride + m * token_stride + 4 * q));
      }
  }
}

// Rows [n0, n1) for tokens [m0, m0 + MB). A ragged last vector (codes % 16) multiplies zero-padded x'.
template <int MB, int D, CodebookLookup LK>
void codebook_rows(const CodebookWeights& w, const CodebookTables& t, const float* acts, int64_t M, int64_t m0,
                   int64_t n0, int64_t n1, float* out) {
  constexpr int kSets = kAccSets<MB, D>;
  const int64_t codes = w.K / D, full = codes / kCodeStreams, tail = codes % kCodeStreams;
  const float* x = acts + m0 * codes;  // plane c of token m0 + m at x + (c M + m) codes
  float padded[D][MB][kCodeStreams] = {};
  for (int c = 0; c < D; ++c)
    for (int m = 0; m < MB; ++m) std::copy_n(x + (c * M + m) * codes + full * kCodeStreams, tail, padded[c][m]);
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* row = w.words + n * w.row_words;
    float32x4_t acc[kSets][MB][D];
#pragma GCC unroll 8
    for (int s = 0; s < kSets; ++s)
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
        for (int c = 0; c < D; ++c) acc[s][m][c] = vdupq_n_f32(0.f);
    uint32x4_t vec[4];
    for (int64_t v = 0; v < full; ++v) {
      code_vector(row, v, w.code_bits, vec);
      fma_vector<MB, D, LK>(acc, t, vec, x + v * kCodeStreams, M * codes, codes);
    }
    if (tail) {
      code_vector(row, full, w.code_bits, vec);
      fma_vector<MB, D, LK>(acc, t, vec, &padded[0][0][0], MB * kCodeStreams, kCodeStreams);
    }
    const float scale = static_cast<float>(w.scales[n]), bias = w.bias ? w.bias[n] : 0.f;
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      float32x4_t sum = acc[0][m][0];
#pragma GCC unroll 8
      for (int s = 0; s < kSets; ++s)
#pragma GCC unroll 8
        for (int c = 0; c < D; ++c)
          if (s + c > 0) sum = vaddq_f32(sum, acc[s][m][c]);
      out[(m0 + m) * w.N + n] = vaddvq_f32(sum) * scale + bias;
    }
  }
}

template <int D, CodebookLookup LK>
void codebook_gemv(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1, float* out) {
  const CodebookTables t = codebook_tables(w);
  for_token_blocks<kMaxTokenBlock>(M, [&](auto T, int64_t m0) {
    codebook_rows<decltype(T)::value, D, LK>(w, t, acts, M, m0, n0, n1, out);
  });
}

// Rows [n0, n1) decoded and scaled; a ragged last vector goes through a buffer.
template <int D, CodebookLookup LK>
void codebook_decode(const CodebookWeights& w, int64_t n0, int64_t n1, float* dst) {
  const CodebookTables t = codebook_tables(w);
  const int64_t codes = w.K / D, full = codes / kCodeStreams, tail = codes % kCodeStreams;
  const auto decode_vector = [&](const uint32_t* row, int64_t v, float32x4_t scale, float* out) {
    uint32x4_t vec[4];
    code_vector(row, v, w.code_bits, vec);
#pragma GCC unroll 8
    for (int q = 0; q < 4; ++q) {
      float32x4_t val[D];
      row_values<D, LK>(t, vec[q], val);
#pragma GCC unroll 8
      for (int c = 0; c < D; ++c) vst1q_f32(out + D * 4 * q + 4 * c, vmulq_f32(val[c], scale));
    }
  };
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* row = w.words + n * w.row_words;
    const float32x4_t scale = vdupq_n_f32(static_cast<float>(w.scales[n]));
    float* out = dst + (n - n0) * w.K;
    for (int64_t v = 0; v < full; ++v) decode_vector(row, v, scale, out + v * kCodeStreams * D);
    if (tail) {
      float buf[kCodeStreams * D];
      decode_vector(row, full, scale, buf);
      std::memcpy(out + full * kCodeStreams * D, buf, sizeof(float) * tail * D);
    }
  }
}

}  // namespace
}  // namespace palette_neon

using namespace palette_neon;

void codebook_gemv_neon(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1, float* out) {
  const bool in_registers = (int64_t{1} << w.code_bits) <= kRegisterEntries;
  if (w.dim == 1) {
    if (in_registers) return codebook_gemv<1, kRegisterTable>(w, acts, M, n0, n1, out);
    return codebook_gemv<1, kLaneLoads>(w, acts, M, n0, n1, out);
  }
  if (in_registers) return codebook_gemv<2, kRegisterTable>(w, acts, M, n0, n1, out);
  codebook_gemv<2, kLaneLoads>(w, acts, M, n0, n1, out);
}

void codebook_decode_neon(const CodebookWeights& w, int64_t n0, int64_t n1, float* dst) {
  const bool in_registers = (int64_t{1} << w.code_bits) <= kRegisterEntries;
  if (w.dim == 1) {
    if (in_registers) return codebook_decode<1, kRegisterTable>(w, n0, n1, dst);
    return codebook_decode<1, kLaneLoads>(w, n0, n1, dst);
  }
  if (in_registers) return codebook_decode<2, kRegisterTable>(w, n0, n1, dst);
  codebook_decode<2, kLaneLoads>(w, n0, n1, dst);
}

}  // namespace torch_lowbit
#endif  // __aarch64__
