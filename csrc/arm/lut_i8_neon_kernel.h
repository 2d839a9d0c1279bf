// The NEON tile kernel of lut{b}_i8_n16 and kquant_i8_n16 (common/lut_i8.h), shared by
// lut_i8_neon.cpp (plain NEON dot product) and lut_i8_dotprod.cpp (sdot, compiled for
// Armv8.2-a+dotprod): each includes
// this into its own anonymous namespace with its Dot policy, Dot::dot<LANE>(acc, vals, x) adding
// sum_j vals[4i + j] * x[4 LANE + j] to lane i of acc (4 rows x 4 codes against one activation
// quad). Same operations in the same order as lut_i8_scalar, so every path agrees bit for bit.
// Group codebooks (gcb2 / gcb3, the seed paper's register-resident tables): the 16 codebooks' int8
// entries live in 4 (gcb2: 64 bytes) or 8 (gcb3: 128) registers; each row's codebook index, moved to
// c << b, is or-ed into its code bytes and one tbl over 4 registers (gcb3: tbl + tbx) looks the value
// up; the block factor is the row's 4-bit sub-scale times the activation scale.
// Integer sub-scales (K-quants): the dot products of each sub-block (16 or 32 features) stay apart in
// int32, are weighted by the rows' int8 sub-scales (and the uint8 sub-mins times the sub-block's q sum)
// in int32, and go to float once per block, as sub_scaled_scalar.
#pragma once
#include <arm_neon.h>

#include <algorithm>

#include "common/lut_i8.h"

namespace torch_lowbit {
namespace {

// The signed values of quad QD (codes 4QD .. 4QD+3) of rows 4rq .. 4rq+3 of the (tile, block) at p:
// the layout of common/lut_i8.h read with NEON. A plane of width W holds quad QD in chunk QD % W at
// bit offset W * (QD / W); 3-bit codes add their high bit from the 1-bit plane at byte 128, 5- and
// 6-bit codes their high 1 or 2 bits from the plane at byte 256 (after the 4-bit plane). The table
// lookup is one tbl (table padded to 16 entries); 8-bit codes (q + 128) take one eor; 5- and 6-bit
// codes, whose table is table[0] + code (the op checks), one add of table[0].
// Lookup: the tables in registers (gcb: all codebooks) and, for gcb, each row's codebook offset.
struct Lookup {
  int8x16_t table;        // <= 16 entries (5, 6 bits: table[0] in every byte)
  int8x16x4_t books[2];   // gcb: entries 0-63, 64-127
  uint8x16_t select[4];   // gcb: per row quad rq, byte 4r + j = (codebook of row 4rq + r) << BITS
};

template <int BITS, int QD, bool GCB = false>
inline int8x16_t quad_values(const uint8_t* p, int rq, const Lookup& lk) {
  constexpr bool WIDE = BITS == 5 || BITS == 6;  // planes 4 + (BITS - 4)
  constexpr int W = BITS == 3 ? 2 : WIDE ? 4 : BITS;
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
  if constexpr (WIDE) {  // the high plane of width H at byte 256: quad QD in chunk QD % H, bits H * (QD / H)
    constexpr int H = BITS - 4, HSHIFT = H * (QD / H);
    uint8x16_t hi = vld1q_u8(p + 256 + (QD % H) * 64 + rq * 16);
    if constexpr (HSHIFT > 0) hi = vshrq_n_u8(hi, HSHIFT);
    if constexpr (HSHIFT + H < 8) hi = vandq_u8(hi, vdupq_n_u8((1 << H) - 1));
    c = vsliq_n_u8(c, hi, 4);  // c | hi << 4 (c holds 4 bits)
    return vaddq_s8(vreinterpretq_s8_u8(c), lk.table);  // table[0] + code, exact in int8
  }
  if constexpr (GCB) {
    const uint8x16_t idx = vorrq_u8(c, lk.select[rq]);
    const int8x16_t v64 = vqtbl4q_s8(lk.books[0], idx);  // indices >= 64 give 0 here ...
    if constexpr (BITS == 2) return v64;
    return vqtbx4q_s8(v64, lk.books[1], vsubq_u8(idx, vdupq_n_u8(64)));  // ... and are filled from the rest
  }
  return vqtbl1q_s8(lk.table, c);
}

// lo[rq] += the dot products of rows 4rq .. 4rq+3 with quad QD (activations x0, features 0-15), hi[rq]
// with quad QD + 4 (x1, features 16-31): the same array unless the two halves are summed apart
// (K-quant sub-blocks of 16).
template <class Dot, int BITS, int QD, bool GCB>
inline void block_quads(const uint8_t* p, const Lookup& lk, int8x16_t x0, int8x16_t x1, int32x4_t* lo,
                        int32x4_t* hi) {
#pragma GCC unroll 4
  for (int rq = 0; rq < 4; ++rq) {
    lo[rq] = Dot::template dot<QD>(lo[rq], quad_values<BITS, QD, GCB>(p, rq, lk), x0);
    hi[rq] = Dot::template dot<QD>(hi[rq], quad_values<BITS, QD + 4, GCB>(p, rq, lk), x1);
  }
}

// Lanes 4rq .. 4rq+3 of 16 int8 / uint8 values, widened to int32 (the rows of row quad rq).
inline int32x4_t widen_s8(int8x16_t v, int rq) {
  const int16x8_t h = rq < 2 ? vmovl_s8(vget_low_s8(v)) : vmovl_high_s8(v);
  return vmovl_s16(rq % 2 ? vget_high_s16(h) : vget_low_s16(h));
}
inline int32x4_t widen_u8(uint8x16_t v, int rq) {
  const uint16x8_t h = rq < 2 ? vmovl_u8(vget_low_u8(v)) : vmovl_high_u8(v);
  return vreinterpretq_s32_u32(vmovl_u16(rq % 2 ? vget_high_u16(h) : vget_low_u16(h)));
}

// SUB: 0, or the K-quants' sub-block (16 or 32 features per integer sub-scale).
template <class Dot, int BITS, bool GCB = false, int SUB = 0>
void kernel(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  int8_t signed_table[128] = {0};  // the table (gcb: the codebooks back to back) as signed values
  for (int i = 0; i < (GCB ? 128 : w.pairs ? 2 << BITS : 1 << BITS) && BITS < 8; ++i)
    signed_table[i] = static_cast<int8_t>(w.utable[i] - w.offset);
  Lookup lk, second;  // pairs: `second` looks the odd blocks up in the second coordinate's table
  lk.table = BITS == 5 || BITS == 6 ? vdupq_n_s8(signed_table[0]) : vld1q_s8(signed_table);
  if constexpr (BITS <= 4) second.table = vld1q_s8(signed_table + (1 << BITS));
  else second.table = lk.table;  // never read (pairs take codes of at most 4 bits): set for the compiler
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
        float32x4_t macc[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};  // sub-mins
        for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
          const int64_t b = g * blocks_per_group + bb;
          const uint8_t* p = lut_i8_block(w, t, b);
          const Lookup& lb = w.pairs && (b & 1) ? second : lk;
          const int8_t* xq = a.q + m * a.K + b * 32;
          const int8x16_t x0 = vld1q_s8(xq), x1 = vld1q_s8(xq + 16);
          // isum[4 + rq]: the second half's dot products (sub-blocks of 16)
          int32x4_t isum[8] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0),
                               vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
          int32x4_t* hi = SUB == 16 ? isum + 4 : isum;
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
          block_quads<Dot, BITS, 0, GCB>(p, lb, x0, x1, isum, hi);
          block_quads<Dot, BITS, 1, GCB>(p, lb, x0, x1, isum, hi);
          block_quads<Dot, BITS, 2, GCB>(p, lb, x0, x1, isum, hi);
          block_quads<Dot, BITS, 3, GCB>(p, lb, x0, x1, isum, hi);
          if constexpr (SUB != 0) {
            // The signed table's dot products are dot_h - offset * xsum_h; weight them (and the mins'
            // q sums) by the rows' sub-scales in int32, then one convert and fma each, as the scalar path.
            constexpr int SUBS = 32 / SUB;
            int32x4_t wsum[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
            int32x4_t msum[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
            for (int h = 0; h < SUBS; ++h) {
              const int64_t s = lut_i8_sub_index(w, t, b * SUBS + h);
              const int8x16_t sc = vld1q_s8(w.sub_scales + s);
              const int32_t xsum = SUBS == 1 ? a.sum[m * kb_count + b] : a.half_sum[m * 2 * kb_count + 2 * b + h];
              for (int rq = 0; rq < 4; ++rq) wsum[rq] = vmlaq_s32(wsum[rq], isum[4 * h + rq], widen_s8(sc, rq));
              if (w.sub_mins) {
                const uint8x16_t mn = vld1q_u8(w.sub_mins + s);
                for (int rq = 0; rq < 4; ++rq) msum[rq] = vmlaq_n_s32(msum[rq], widen_u8(mn, rq), xsum);
              }
            }
            const float32x4_t xd = vdupq_n_f32(a.d[m * kb_count + b]);
            for (int rq = 0; rq < 4; ++rq) {
              gacc[rq] = vfmaq_f32(gacc[rq], vcvtq_f32_s32(wsum[rq]), xd);
              if (w.sub_mins) macc[rq] = vfmaq_f32(macc[rq], vcvtq_f32_s32(msum[rq]), xd);  // else 0, as scalar's
            }
            continue;
          }
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
            // K-quants: min * macc (the sub-mins' sums); else min * the group's activation sum
            const float32x4_t msum = SUB ? macc[rq] : vdupq_n_f32(a.group_dsum[m * groups + g]);
            acc[rq] = vfmaq_f32(acc[rq], vcvt_f32_f16(vld1_f16(mp + 4 * rq)), msum);
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
  if (w.sub_scales) {  // K-quants (never 8-bit codes, never per-token activations: the op checks)
    return with_code_bits(w.bits, [&](auto bits) {
      constexpr int B = decltype(bits)::value;
      if constexpr (B == 8) return lut_i8_scalar(w, a, t0, t1, out, ldo);
      else if (w.sub_block == 16) return kernel<Dot, B, false, 16>(w, a, t0, t1, out, ldo);
      else return kernel<Dot, B, false, 32>(w, a, t0, t1, out, ldo);
    });
  }
  with_code_bits(w.bits, [&](auto bits) { kernel<Dot, decltype(bits)::value>(w, a, t0, t1, out, ldo); });
}

}  // namespace
}  // namespace torch_lowbit
