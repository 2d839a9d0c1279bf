// The NEON tile kernel of lut{4,8}_i8_n16 (common/lut_i8.h), shared by lut_i8_neon.cpp (plain
// NEON dot product) and lut_i8_dotprod.cpp (sdot, compiled for Armv8.2-a+dotprod): each includes
// this into its own anonymous namespace with its Dot policy, Dot::dot<LANE>(acc, vals, x) adding
// sum_j vals[4i + j] * x[4 LANE + j] to lane i of acc (4 rows x 4 codes against one activation
// quad). Same operations in the same order as lut_i8_scalar, so every path agrees bit for bit.
// Group codebooks (gcb2 / gcb3, the seed paper's register-resident tables): the 16 codebooks' int8
// entries live in 4 (gcb2: 64 bytes) or 8 (gcb3: 128) registers; each row's codebook index, moved to
// c << b, is or-ed into its code bytes and one tbl over 4 registers (gcb3: tbl + tbx) looks the value
// up; the block factor is the row's 4-bit sub-scale times the activation scale.
#pragma once
#include <arm_neon.h>

#include <algorithm>

#include "common/lut_i8.h"

namespace torch_lowbit {
namespace {

// The signed values of quad QD (codes 4QD .. 4QD+3) of rows 4rq .. 4rq+3 of the (tile, block) at p:
// the layout of common/lut_i8.h read with NEON. A plane of width W holds quad QD in chunk QD % W at
// bit offset W * (QD / W); 3-bit codes add their high bit from the 1-bit plane at byte 128. The
// table lookup is one tbl (table padded to 16 entries); 8-bit codes (q + 128) take one eor.
// Lookup: the tables in registers (gcb: all codebooks) and, for gcb, each row's codebook offset.
struct Lookup {
  int8x16_t table;        // <= 16 entries
  int8x16x4_t books[2];   // gcb: entries 0-63, 64-127
  uint8x16_t select[4];   // gcb: per row quad rq, byte 4r + j = (codebook of row 4rq + r) << BITS
};

template <int BITS, int QD, bool GCB = false>
inline int8x16_t quad_values(const uint8_t* p, int rq, const Lookup& lk) {
  constexpr int W = BITS == 3 ? 2 : BITS;
  constexpr int SHIFT = W * (QD / W);
  const uint8x16_t v = vld1q_u8(p + (QD % W) * 64 + rq * 16);
  if constexpr (BITS == 8) return vreinterpretq_s8_u8(veorq_u8(v, vdupq_n_u8(0x80)));
  uint8x16_t c = v;
  if constexpr (SHIFT > 0) c = vshrq_n_u8(c, SHIFT);
  if constexpr (SHIFT + W < 8) c = vandq_u8(c, vdupq_n_u8((1 << W) - 1));  // the top field needs no mask
  if constexpr (BITS == 3) {
    uint8x16_t hi = vld1q_u8(p + 128 + rq * 16);
    if constexpr (QD > 0) hi = vshrq_n_u8(hi, QD);
    c = vorrq_u8(c, vshlq_n_u8(vandq_u8(hi, vdupq_n_u8(1)), 2));
  }
  if constexpr (GCB) {
    const uint8x16_t idx = vorrq_u8(c, lk.select[rq]);
    const int8x16_t v64 = vqtbl4q_s8(lk.books[0], idx);  // indices >= 64 give 0 here ...
    if constexpr (BITS == 2) return v64;
    return vqtbx4q_s8(v64, lk.books[1], vsubq_u8(idx, vdupq_n_u8(64)));  // ... and are filled from the rest
  }
  return vqtbl1q_s8(lk.table, c);
}

// isum[rq] += the dot products of rows 4rq .. 4rq+3 with quads QD and QD + 4 (activations x0 | x1).
template <class Dot, int BITS, int QD, bool GCB>
inline void block_quads(const uint8_t* p, const Lookup& lk, int8x16_t x0, int8x16_t x1, int32x4_t* isum) {
#pragma GCC unroll 4
  for (int rq = 0; rq < 4; ++rq) {
    isum[rq] = Dot::template dot<QD>(isum[rq], quad_values<BITS, QD, GCB>(p, rq, lk), x0);
    isum[rq] = Dot::template dot<QD>(isum[rq], quad_values<BITS, QD + 4, GCB>(p, rq, lk), x1);
  }
}

template <class Dot, int BITS, bool GCB = false>
void kernel(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  int8_t signed_table[128] = {0};  // the table (gcb: the codebooks back to back) as signed values
  for (int i = 0; i < (GCB ? 128 : w.pairs ? 2 << BITS : 1 << BITS) && BITS < 8; ++i)
    signed_table[i] = static_cast<int8_t>(w.utable[i] - w.offset);
  Lookup lk, second;  // pairs: `second` looks the odd blocks up in the second coordinate's table
  lk.table = vld1q_s8(signed_table);
  if constexpr (BITS <= 4) second.table = vld1q_s8(signed_table + (1 << BITS));
  if constexpr (GCB) {
    lk.books[0] = vld1q_s8_x4(signed_table);
    lk.books[1] = vld1q_s8_x4(signed_table + 64);
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t rows = std::min(kI8TileRows, w.N - t * kI8TileRows);
    for (int64_t m = 0; m < a.M; ++m) {
      float bias[kI8TileRows] = {0};
      for (int64_t r = 0; r < rows && w.bias; ++r) bias[r] = w.bias[t * kI8TileRows + r];
      float32x4_t acc[4];
      for (int rq = 0; rq < 4; ++rq) acc[rq] = vld1q_f32(bias + 4 * rq);
      for (int64_t g = 0; g < groups; ++g) {
        float32x4_t gacc[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
        int32x4_t gisum[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};  // per token
        for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
          const int64_t b = g * blocks_per_group + bb;
          const uint8_t* p = lut_i8_block(w, t, b);
          const Lookup& lb = w.pairs && (b & 1) ? second : lk;
          const int8_t* xq = a.q + m * a.K + b * 32;
          const int8x16_t x0 = vld1q_s8(xq), x1 = vld1q_s8(xq + 16);
          int32x4_t isum[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
          float32x4_t steps[4];  // gcb: the rows' sub-scales
          if constexpr (GCB) {
            const uint8x16_t sub = vld1q_u8(w.sub_groups + (t * kb_count + b) * kI8TileRows);
            const uint8x16_t books = vshlq_n_u8(vshrq_n_u8(sub, 4), BITS);
            const uint16x8_t s16[2] = {vmovl_u8(vget_low_u8(vandq_u8(sub, vdupq_n_u8(15)))),
                                       vmovl_high_u8(vandq_u8(sub, vdupq_n_u8(15)))};
            for (int rq = 0; rq < 4; ++rq) {
              const uint8_t spread[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};  // row r's byte to 4 lanes
              lk.select[rq] = vqtbl1q_u8(books, vaddq_u8(vld1q_u8(spread), vdupq_n_u8(4 * rq)));
              const uint16x4_t s4 = rq % 2 ? vget_high_u16(s16[rq / 2]) : vget_low_u16(s16[rq / 2]);
              steps[rq] = vcvtq_f32_u32(vmovl_u16(s4));
            }
          }
          block_quads<Dot, BITS, 0, GCB>(p, lb, x0, x1, isum);
          block_quads<Dot, BITS, 1, GCB>(p, lb, x0, x1, isum);
          block_quads<Dot, BITS, 2, GCB>(p, lb, x0, x1, isum);
          block_quads<Dot, BITS, 3, GCB>(p, lb, x0, x1, isum);
          if (!GCB && a.per_token) {  // the group's integer sum, converted once below (never with gcb)
            for (int rq = 0; rq < 4; ++rq) gisum[rq] = vaddq_s32(gisum[rq], isum[rq]);
            continue;
          }
          const float32x4_t xd = vdupq_n_f32(a.d[m * kb_count + b]);
          for (int rq = 0; rq < 4; ++rq)  // gcb: factor = float(sub-scale) * xd, as lut_i8_block_factor
            gacc[rq] = vfmaq_f32(gacc[rq], vcvtq_f32_s32(isum[rq]), GCB ? vmulq_f32(steps[rq], xd) : xd);
        }
        if (!GCB && a.per_token)
          for (int rq = 0; rq < 4; ++rq) gacc[rq] = vmulq_f32(vcvtq_f32_s32(gisum[rq]), vdupq_n_f32(a.d[m * kb_count]));
        const int64_t pidx = (t * groups + g) * kI8TileRows;
        const auto* sp = reinterpret_cast<const float16_t*>(w.scales + pidx);
        for (int rq = 0; rq < 4; ++rq) {
          acc[rq] = vfmaq_f32(acc[rq], gacc[rq], vcvt_f32_f16(vld1_f16(sp + 4 * rq)));
          if (w.mins) {
            const auto* mp = reinterpret_cast<const float16_t*>(w.mins + pidx);
            acc[rq] = vfmaq_f32(acc[rq], vcvt_f32_f16(vld1_f16(mp + 4 * rq)), vdupq_n_f32(a.group_dsum[m * groups + g]));
          }
        }
      }
      float res[kI8TileRows];
      for (int rq = 0; rq < 4; ++rq) vst1q_f32(res + 4 * rq, acc[rq]);
      for (int64_t r = 0; r < rows; ++r) out[m * ldo + t * kI8TileRows + r] = res[r];
    }
  }
}

template <class Dot>
void lut_i8_neon_tiles(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  if (w.sub_groups) {  // gcb: per-(row, block) codebooks in registers
    if (w.bits == 2) return kernel<Dot, 2, true>(w, a, t0, t1, out, ldo);
    if (w.bits == 3) return kernel<Dot, 3, true>(w, a, t0, t1, out, ldo);
    return lut_i8_scalar(w, a, t0, t1, out, ldo);
  }
  with_code_bits(w.bits, [&](auto bits) { kernel<Dot, decltype(bits)::value>(w, a, t0, t1, out, ldo); });
}

}  // namespace
}  // namespace torch_lowbit
