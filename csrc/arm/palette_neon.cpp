// NEON path of the TCQ kernels (palette.h) for the computed 1mad code; the hybrid code (a table
// lookup per trellis step: NEON has no gather) runs the scalar path.
//
// Tile row r is steps 8 r .. 8 r + 7, whose 16-bit windows lie in the 16 sequence bytes from the
// word-aligned byte base_r = 4 floor(8 r s / 32) on (s <= 10: at most 3 + 9 + 4 bytes). One 16-byte
// load (rows that run past the sequence's end assemble those bytes cyclically: the tail-biting wrap)
// and one tbl per 4 lanes put each window's 4 stream bytes into a lane, most significant first (the
// words are little-endian, the stream MSB-first: stream byte k sits at memory byte k ^ 3); a right
// shift and a mask leave the state. Then per coordinate c: vmulq_u32 + vaddq_u32 (A_c state + B_c)
// and two pairwise widening adds (vpaddlq_u8, vpaddlq_u16) sum the four bytes. The GEMV reads x' in
// split-column order (tcq_split_columns) and subtracts the offset 510 once per row as 510 sum(x'), as
// the x86 kernels do; the decode subtracts it per value and interleaves, bit for bit the scalar path.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <vector>

#include "common/palette.h"

namespace torch_lowbit {
namespace {

constexpr int kMaxTokenBlock = 4;

struct TcqNeonRow {
  uint8x16_t index[2];  // tbl indices of lanes 0-3 and 4-7: the window's 4 stream bytes, MSB first
  int32x4_t shift[2];   // -(16 - p % 8): the right shift that leaves the state in bits 15..0
  int base;             // the row's first memory byte in its sequence (word-aligned)
  bool wraps;           // its 16 bytes run past the sequence's end
};

struct TcqNeonLanes {
  TcqNeonRow rows[kTcqTile];
  int seq_bytes;
};

TcqNeonLanes tcq_neon_lanes(int shift) {
  TcqNeonLanes k;
  k.seq_bytes = 16 * shift;
  for (int r = 0; r < kTcqTile; ++r) {
    TcqNeonRow& row = k.rows[r];
    row.base = 4 * ((8 * r * shift) >> 5);
    row.wraps = row.base + 16 > k.seq_bytes;
    uint8_t index[16];
    int32_t shifts[8];
    for (int l = 0; l < 8; ++l) {
      const int p = (8 * r + l) * shift, k0 = p >> 3;
      for (int j = 0; j < 4; ++j) {  // lane byte j (LSB first) = stream byte k0 + 3 - j
        const int mem = ((k0 + 3 - j) ^ 3) - row.base;
        index[4 * (l % 4) + j] = static_cast<uint8_t>(mem);
      }
      shifts[l] = -(16 - (p & 7));
      if (l % 4 == 3) row.index[l / 4] = vld1q_u8(index);
    }
    row.shift[0] = vld1q_s32(shifts);
    row.shift[1] = vld1q_s32(shifts + 4);
  }
  return k;
}

// The 16 bytes of `seq` from the row's base (cyclic where the row wraps).
inline uint8x16_t row_bytes(const uint8_t* seq, const TcqNeonRow& row, int seq_bytes) {
  if (!row.wraps) return vld1q_u8(seq + row.base);
  uint8_t buf[16];
  for (int j = 0; j < 16; ++j) buf[j] = seq[(row.base + j) % seq_bytes];
  return vld1q_u8(buf);
}

// The four-byte sums of (A_c state + B_c) mod 2^32 for 4 states.
inline uint32x4_t mad_sums(uint32x4_t state, int c) {
  const uint32x4_t z = vaddq_u32(vmulq_u32(state, vdupq_n_u32(kTcqMadMultipliers[c])), vdupq_n_u32(kTcqMadIncrements[c]));
  return vpaddlq_u16(vpaddlq_u8(vreinterpretq_u8_u32(z)));
}

// Byte sums of tile row r (unsubtracted): s[c][h] = coordinate c of steps 4 h .. 4 h + 3.
inline void row_sums(const uint8_t* seq, const TcqNeonRow& row, int seq_bytes, uint32x4_t s[2][2]) {
  const uint8x16_t bytes = row_bytes(seq, row, seq_bytes);
  const uint32x4_t mask = vdupq_n_u32(0xFFFF);
  for (int h = 0; h < 2; ++h) {
    const uint32x4_t window = vreinterpretq_u32_u8(vqtbl1q_u8(bytes, row.index[h]));
    const uint32x4_t state = vandq_u32(vshlq_u32(window, row.shift[h]), mask);
    s[0][h] = mad_sums(state, 0);
    s[1][h] = mad_sums(state, 1);
  }
}

template <int MB>
void tcq_mad_band(const TcqWeights& w, const TcqNeonLanes& k, const float* x, const float* x_sums, int64_t m0,
                  int64_t b, float* out) {
  const int64_t tiles = w.K / kTcqTile;
  const uint8_t* band = reinterpret_cast<const uint8_t*>(w.words + b * tiles * 4 * w.shift);
  for (int r = 0; r < kTcqTile; ++r) {
    float32x4_t acc[MB][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = vdupq_n_f32(0.f);
    const uint8_t* seq = band;
    const float* xt = x + m0 * w.K;
    for (int64_t t = 0; t < tiles; ++t, seq += k.seq_bytes, xt += kTcqTile) {
      uint32x4_t s[2][2];
      row_sums(seq, k.rows[r], k.seq_bytes, s);
      for (int c = 0; c < 2; ++c)
        for (int h = 0; h < 2; ++h) {
          const float32x4_t v = vcvtq_f32_u32(s[c][h]);
          for (int m = 0; m < MB; ++m)  // split columns: coordinate c of steps 4h.. at x' 8c + 4h
            acc[m][h] = vfmaq_f32(acc[m][h], v, vld1q_f32(xt + m * w.K + 8 * c + 4 * h));
        }
    }
    const int64_t n = b * kTcqTile + r;
    const float scale = static_cast<float>(w.scales[n]), bias = w.bias ? w.bias[n] : 0.f;
    for (int m = 0; m < MB; ++m) {
      const float dot = vaddvq_f32(vaddq_f32(acc[m][0], acc[m][1]));
      out[(m0 + m) * w.N + n] = (dot - kTcqMadOffset * x_sums[m0 + m]) * (scale * kTcqMadUnit) + bias;
    }
  }
}

}  // namespace

void tcq_gemv_neon(const TcqWeights& w, const float* x, int64_t M, int64_t b0, int64_t b1, float* out) {
  if (w.table_bits != kTcqMadTableBits) return tcq_gemv_scalar(w, x, M, b0, b1, out);
  const TcqNeonLanes k = tcq_neon_lanes(w.shift);
  std::vector<float> split(M * w.K), sums(M);
  tcq_split_columns(x, M, w.K, split.data(), sums.data());
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t m0 = 0; m0 < M; m0 += kMaxTokenBlock) {
      switch (std::min<int64_t>(kMaxTokenBlock, M - m0)) {
        case 1: tcq_mad_band<1>(w, k, split.data(), sums.data(), m0, b, out); break;
        case 2: tcq_mad_band<2>(w, k, split.data(), sums.data(), m0, b, out); break;
        case 3: tcq_mad_band<3>(w, k, split.data(), sums.data(), m0, b, out); break;
        default: tcq_mad_band<4>(w, k, split.data(), sums.data(), m0, b, out); break;
      }
    }
}

void tcq_decode_neon(const TcqWeights& w, int64_t b0, int64_t b1, float* dst) {
  if (w.table_bits != kTcqMadTableBits) return tcq_decode_scalar(w, b0, b1, dst);
  const TcqNeonLanes k = tcq_neon_lanes(w.shift);
  const int64_t tiles = w.K / kTcqTile;
  const int32x4_t offset = vdupq_n_s32(kTcqMadOffset);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* band = reinterpret_cast<const uint8_t*>(w.words + b * tiles * 4 * w.shift);
    for (int r = 0; r < kTcqTile; ++r) {
      const int64_t n = b * kTcqTile + r;
      // integer values times scale / 128: the same single rounding as value / 128 times scale
      const float32x4_t scale = vdupq_n_f32(static_cast<float>(w.scales[n]) * kTcqMadUnit);
      float* row = dst + (n - b0 * kTcqTile) * w.K;
      const uint8_t* seq = band;
      for (int64_t t = 0; t < tiles; ++t, seq += k.seq_bytes) {
        uint32x4_t s[2][2];
        row_sums(seq, k.rows[r], k.seq_bytes, s);
        for (int h = 0; h < 2; ++h) {
          const float32x4_t v0 = vmulq_f32(vcvtq_f32_s32(vsubq_s32(vreinterpretq_s32_u32(s[0][h]), offset)), scale);
          const float32x4_t v1 = vmulq_f32(vcvtq_f32_s32(vsubq_s32(vreinterpretq_s32_u32(s[1][h]), offset)), scale);
          vst1q_f32(row + t * kTcqTile + 8 * h, vzip1q_f32(v0, v1));  // steps 4h, 4h+1: x y x y
          vst1q_f32(row + t * kTcqTile + 8 * h + 4, vzip2q_f32(v0, v1));
        }
      }
    }
  }
}

}  // namespace torch_lowbit
#endif  // __aarch64__
