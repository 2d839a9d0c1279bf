// NEON paths of the TCQ kernels (palette.h): the computed 1mad code and the hybrid table code.
//
// Tile row r is steps 8 r .. 8 r + 7, whose 16-bit windows lie in the 16 sequence bytes from the
// word-aligned byte base_r = 4 floor(8 r s / 32) on (s <= 10: at most 3 + 9 + 4 bytes). One 16-byte
// load and one tbl per 4 lanes put each window's 4 stream bytes into a lane, most significant first
// (the words are little-endian, the stream MSB-first: stream byte k sits at memory byte k ^ 3); a right
// shift and a mask leave the state. Rows that run past the sequence's end (the tail-biting wrap) load
// its last 16 bytes and its first 16 and read both with one two-register tbl.
// 1mad: per coordinate c, vmulq_u32 + vaddq_u32 (A_c state + B_c) and two pairwise widening adds
// (vpaddlq_u8, vpaddlq_u16) sum the four bytes. The GEMV reads x' in split-column order
// (tcq_split_columns) and subtracts the offset 510 once per row as 510 sum(x'), as the x86 kernels do;
// the decode subtracts it per value and interleaves.
// Hybrid: h = state (state + 1) mod 2^16 is one 16-bit multiply (vmulq_u16), the signed-table index
// h >> (15 - Q) one shift, and each lane's (x, y) entry one 64-bit load (NEON has no gather; Q is 9-11,
// 4-16 KB tables), which leaves the row's values in column order.
// Both decodes are bit for bit the scalar path (one table read or exact integer value, one multiply by
// the row scale); the GEMVs differ from scalar only in the order of the fp32 sums.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <vector>

#include "arm/palette_neon.h"
#include "common/palette.h"
#include "common/token_blocks.h"

namespace torch_lowbit {
namespace palette_neon {
namespace {

struct TcqNeonRow {
  uint8x16_t index[2];  // tbl indices of lanes 0-3 and 4-7 (the window's 4 stream bytes, MSB first) into
                        // the 16 bytes from base or, where the row wraps, the last 16 and the first 16
  int32x4_t shift[2];   // -(16 - p % 8): the right shift that leaves the state in bits 15..0
  int base;             // the row's first memory byte in its sequence (word-aligned)
  bool wraps;           // its 16 bytes run past the sequence's end
};

struct TcqNeonLanes {
  TcqNeonRow rows[kTcqTile];
  int seq_bytes;
  const float* table;    // hybrid: the signed table (tcq_value)
  int32x4_t hash_shift;  // hybrid: -(15 - Q), h >> (15 - Q) as a left shift
};

TcqNeonLanes tcq_neon_lanes(const TcqWeights& w) {
  TcqNeonLanes k;
  const int shift = w.shift;
  k.seq_bytes = 16 * shift;
  k.table = w.table;
  k.hash_shift = vdupq_n_s32(w.table_bits - 15);
  for (int r = 0; r < kTcqTile; ++r) {
    TcqNeonRow& row = k.rows[r];
    row.base = 4 * ((8 * r * shift) >> 5);
    row.wraps = row.base + 16 > k.seq_bytes;
    uint8_t index[16];
    int32_t shifts[8];
    for (int l = 0; l < 8; ++l) {
      const int p = (8 * r + l) * shift, k0 = p >> 3;
      for (int j = 0; j < 4; ++j) {  // lane byte j (LSB first) = stream byte k0 + 3 - j
        const int mem = (k0 + 3 - j) ^ 3;  // past the sequence's end: byte mem - seq_bytes from its start
        const int at = !row.wraps ? mem - row.base
                       : mem < k.seq_bytes ? mem - (k.seq_bytes - 16) : 16 + mem - k.seq_bytes;
        index[4 * (l % 4) + j] = static_cast<uint8_t>(at);
      }
      shifts[l] = -(16 - (p & 7));
      if (l % 4 == 3) row.index[l / 4] = vld1q_u8(index);
    }
    row.shift[0] = vld1q_s32(shifts);
    row.shift[1] = vld1q_s32(shifts + 4);
  }
  return k;
}

// The states of tile row r: steps 4 h .. 4 h + 3 in state[h].
inline void row_states(const uint8_t* seq, const TcqNeonRow& row, int seq_bytes, uint32x4_t (&state)[2]) {
  uint8x16_t windows[2];
  if (!row.wraps) {
    const uint8x16_t bytes = vld1q_u8(seq + row.base);
    windows[0] = vqtbl1q_u8(bytes, row.index[0]);
    windows[1] = vqtbl1q_u8(bytes, row.index[1]);
  } else {
    const uint8x16x2_t bytes = {{vld1q_u8(seq + seq_bytes - 16), vld1q_u8(seq)}};
    windows[0] = vqtbl2q_u8(bytes, row.index[0]);
    windows[1] = vqtbl2q_u8(bytes, row.index[1]);
  }
  const uint32x4_t mask = vdupq_n_u32(0xFFFF);
#pragma GCC unroll 8
  for (int h = 0; h < 2; ++h) state[h] = vandq_u32(vshlq_u32(vreinterpretq_u32_u8(windows[h]), row.shift[h]), mask);
}

// The four-byte sums of (A_c state + B_c) mod 2^32 for 4 states.
inline uint32x4_t mad_sums(uint32x4_t state, int c) {
  const uint32x4_t z = vaddq_u32(vmulq_u32(state, vdupq_n_u32(kTcqMadMultipliers[c])), vdupq_n_u32(kTcqMadIncrements[c]));
  return vpaddlq_u16(vpaddlq_u8(vreinterpretq_u8_u32(z)));
}

// The hybrid code's (x, y) of 4 states (steps 4 h ..), in column order: steps 4h, 4h+1 in `first`, 4h+2,
// 4h+3 in `second`. In 16-bit lanes the state's high half is 0 and state + 1's is 0 or 1, so the low
// halves hold h = state (state + 1) mod 2^16 and the high halves 0.
inline void hybrid_pairs(const TcqNeonLanes& k, uint32x4_t state, float32x4_t& first, float32x4_t& second) {
  const uint16x8_t next = vreinterpretq_u16_u32(vaddq_u32(state, vdupq_n_u32(1)));
  const uint32x4_t h = vreinterpretq_u32_u16(vmulq_u16(vreinterpretq_u16_u32(state), next));
  load_pairs(k.table, vshlq_u32(h, k.hash_shift), first, second);  // index (h >> (15 - Q)): Q + 1 bits
}

// Tile row r's values in the GEMV's x' order, v[q] times x'[4 q .. 4 q + 3] of the tile: 1mad, the
// byte sums (offset not subtracted) of coordinate q / 2, steps 4 (q % 2) .. (split columns); hybrid,
// columns 4 q .. 4 q + 3.
template <bool kMad>
inline void gemv_values(const uint8_t* seq, const TcqNeonLanes& k, int r, float32x4_t (&v)[4]) {
  uint32x4_t state[2];
  row_states(seq, k.rows[r], k.seq_bytes, state);
#pragma GCC unroll 8
  for (int h = 0; h < 2; ++h) {
    if constexpr (kMad) {
      v[h] = vcvtq_f32_u32(mad_sums(state[h], 0));
      v[2 + h] = vcvtq_f32_u32(mad_sums(state[h], 1));
    } else {
      hybrid_pairs(k, state[h], v[2 * h], v[2 * h + 1]);
    }
  }
}

// Tile row r's values in column order, unscaled (1mad: in units of 1/128, exact integers).
template <bool kMad>
inline void decoded_columns(const uint8_t* seq, const TcqNeonLanes& k, int r, float32x4_t (&cols)[4]) {
  if constexpr (kMad) {
    uint32x4_t state[2];
    row_states(seq, k.rows[r], k.seq_bytes, state);
    const int32x4_t offset = vdupq_n_s32(kTcqMadOffset);
#pragma GCC unroll 8
    for (int h = 0; h < 2; ++h) {
      const float32x4_t x = vcvtq_f32_s32(vsubq_s32(vreinterpretq_s32_u32(mad_sums(state[h], 0)), offset));
      const float32x4_t y = vcvtq_f32_s32(vsubq_s32(vreinterpretq_s32_u32(mad_sums(state[h], 1)), offset));
      cols[2 * h] = vzip1q_f32(x, y);  // steps 4h, 4h+1: x y x y
      cols[2 * h + 1] = vzip2q_f32(x, y);
    }
  } else {
    gemv_values<false>(seq, k, r, cols);  // already in column order
  }
}

// Band b for tokens [m0, m0 + MB), one tile row at a time over all tiles. 1mad: x holds each tile's
// even columns then its odd ones (tcq_split_columns), x_sums each token's sum of x'.
template <int MB, bool kMad>
void tcq_band(const TcqWeights& w, const TcqNeonLanes& k, const float* x, const float* x_sums, int64_t m0, int64_t b,
              float* out) {
  const int64_t tiles = w.K / kTcqTile;
  const uint8_t* band = reinterpret_cast<const uint8_t*>(w.words + b * tiles * 4 * w.shift);
  for (int r = 0; r < kTcqTile; ++r) {
    float32x4_t acc[MB][2];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
    const uint8_t* seq = band;
    const float* xt = x + m0 * w.K;
    for (int64_t t = 0; t < tiles; ++t, seq += k.seq_bytes, xt += kTcqTile) {
      float32x4_t v[4];
      gemv_values<kMad>(seq, k, r, v);
#pragma GCC unroll 8
      for (int q = 0; q < 4; ++q)
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) acc[m][q % 2] = vfmaq_f32(acc[m][q % 2], v[q], vld1q_f32(xt + m * w.K + 4 * q));
    }
    const int64_t n = b * kTcqTile + r;
    const float scale = static_cast<float>(w.scales[n]), bias = w.bias ? w.bias[n] : 0.f;
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const float dot = vaddvq_f32(vaddq_f32(acc[m][0], acc[m][1]));
      out[(m0 + m) * w.N + n] = kMad ? (dot - kTcqMadOffset * x_sums[m0 + m]) * (scale * kTcqMadUnit) + bias
                                     : dot * scale + bias;
    }
  }
}

template <bool kMad>
void tcq_decode_bands(const TcqWeights& w, int64_t b0, int64_t b1, float* dst) {
  const TcqNeonLanes k = tcq_neon_lanes(w);
  const int64_t tiles = w.K / kTcqTile;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* band = reinterpret_cast<const uint8_t*>(w.words + b * tiles * 4 * w.shift);
    for (int r = 0; r < kTcqTile; ++r) {
      const int64_t n = b * kTcqTile + r;
      // 1mad: integer values times scale / 128, the same single rounding as value / 128 times scale
      const float row_scale = static_cast<float>(w.scales[n]);
      const float32x4_t scale = vdupq_n_f32(kMad ? row_scale * kTcqMadUnit : row_scale);
      float* row = dst + (n - b0 * kTcqTile) * w.K;
      const uint8_t* seq = band;
      for (int64_t t = 0; t < tiles; ++t, seq += k.seq_bytes) {
        float32x4_t cols[4];
        decoded_columns<kMad>(seq, k, r, cols);
        for (int q = 0; q < 4; ++q) vst1q_f32(row + t * kTcqTile + 4 * q, vmulq_f32(cols[q], scale));
      }
    }
  }
}

}  // namespace
}  // namespace palette_neon

using namespace palette_neon;

void tcq_gemv_neon(const TcqWeights& w, const float* x, int64_t M, int64_t b0, int64_t b1, float* out) {
  const TcqNeonLanes k = tcq_neon_lanes(w);
  tcq_gemv_bands<kMaxTokenBlock>(w, x, M, b0, b1, [&](auto T, auto mad, const float* xs, const float* sums, int64_t m0,
                                                    int64_t b) {
    tcq_band<decltype(T)::value, decltype(mad)::value>(w, k, xs, sums, m0, b, out);
  });
}

void tcq_decode_neon(const TcqWeights& w, int64_t b0, int64_t b1, float* dst) {
  if (w.table_bits == kTcqMadTableBits) return tcq_decode_bands<true>(w, b0, b1, dst);
  tcq_decode_bands<false>(w, b0, b1, dst);
}

}  // namespace torch_lowbit
#endif  // __aarch64__
