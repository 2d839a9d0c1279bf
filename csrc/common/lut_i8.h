// Kernels for formats whose b-bit codes (b = 1..6, or 8) index a table of integers (q4_0, int4_g*,
// iq4_nl, nuq*, ...; b = 8: q8_0, whose byte is q + 128 and whose table is code - 128) over int8
// activations.
//
// Layouts "lut{b}_i8_n16" (torch_lowbit/layouts/lut_i8.py packs them): rows in tiles of 16 (N
// padded), K in blocks of 32. qweight [N/16, K/32, 64 b] uint8. A code splits into planes of
// width 4 (b = 4), 2 (b = 2), 2 + 1 (b = 3: low two bits, then the high bit), 4 + 1 (b = 5), 4 + 2
// (b = 6), 1 (b = 1) or 8 (b = 8: chunk qd is quad qd, plain bytes, so 8 loads feed vpdpbusd with no
// shift or mask); a plane
// of width w takes w chunks of 64 bytes, and "quad" qd (codes 4qd .. 4qd+3 of each row, qd < 8)
// sits in chunk qd % w at bit offset w * (qd / w): byte r*4 + j of that chunk holds row r's code
// 4qd + j. So one 64-byte load, a shift and a mask give, per 32-bit lane, 4 consecutive codes of
// one row: vpdpbusd against 4 broadcast activations accumulates 16 rows at once, with no
// horizontal reduction. (b = 4 is the original lut4_i8_n16 byte layout.) scales/mins
// [N/16, K/group, 16] fp16 (16 rows contiguous).
//
// Math per (row, group): for each 32-block of the group, the integer isum = sum_j u[code_j] * xq_j
// - offset * sum_j xq_j, where u = table + offset >= 0 (vpdpbusd multiplies unsigned by signed
// bytes), quads in order 0..7, then gacc = fma(float(isum), xd, gacc) (gacc = 0 at the group's
// start); at the group's end acc = fma(gacc, scale, acc) and, with mins, acc = fma(min, dsum, acc)
// where dsum = sum over the group's blocks of xd * float(sum xq) (Q8Acts::group_dsum, per token,
// shared by all rows). So the float work per block is one convert and one fma; scales and mins are
// applied once per group. Accumulators start at the bias (0 without one). Every path performs
// exactly these operations in this order, so all paths agree bit for bit.
//
// Per-token activations (Q8Acts::per_token: QuaRot's A8 / A4, one scale xd per token): the group's
// isums add up in int32 (exact, whatever the order: -fwrapv, and |sum| < 2^31 for groups of at most
// 65536 features, which the op checks) and gacc = float(isum_group) * xd, converted once per group,
// then the same scale / min epilogue. With one group per row (int4_pc) a whole row is one integer
// dot product. Not with group codebooks (their block factor is per block).
//
// Group codebooks (gcb2/gcb3, layout gcb_i8_n16): sub_groups [N/16, K/32, 16] holds one byte per
// (row, 32-block) = (codebook c << 4) | sub-scale s; the table is the C <= 16 codebooks of 2^b entries
// back to back, so a code q of that row and block reads u[(c << b) | q] (one vpermb / vpermi2b over
// a 64- / 128-byte register table). The group is the superblock (scale = its fp16 d) and the
// block's factor is float(s) * xd instead of xd. No mins.
//
// Pair codebooks (2-D VQ, layout vq_i8_n16; `pairs`): a code stands for two weights, features 2c and
// 2c + 1, and the table is one 2^b-entry table per coordinate (utable[0, 2^b) the first, [2^b, 2^(b+1))
// the second). qweight holds K/2 codes per row ([N/16, K/64, 64 b]); the kernels see K features in
// 32-blocks whose activations the op has put in "pair-split" order: block 2c holds the first
// coordinates of code block c (features 64c, 64c + 2, .., 64c + 62), block 2c + 1 the second ones. So
// block b reads code block b / 2 through table b % 2 (lut_i8_block, lut_i8_table_base), and each code
// block is decoded once for both. No group codebooks with pairs; groups are multiples of 64.
//
// Integer sub-scales (ggml's K-quants, layout kquant_i8_n16; `sub_scales`): each row's sub-blocks of
// `sub_block` = 16 or 32 features carry an int8 scale s (sub_scales [N/16, K/sub_block, 16]) and, with
// sub_mins (uint8, same shape), an integer min m; the group is the super-block, scales its fp16 d and
// mins its -dmin, so w = d * s * (u[code] - offset) - dmin * m. Per block and row the sub-blocks' integer
// sums are weighted in int32: isum = sum_h s_h * (dot_h - offset * xsum_h) and msum = sum_h m_h * xsum_h
// (h: the block's one or two sub-blocks; xsum_h the sum of q over sub-block h: Q8Acts::sum, or
// Q8Acts::half_sum for sub-blocks of 16), then gacc = fma(float(isum), xd, gacc) and
// macc = fma(float(msum), xd, macc); at the group's end acc = fma(gacc, scale, acc) and, with mins,
// acc = fma(min, macc, acc). |isum| < 2^31: |s| <= 128, |u - offset| <= 255, 32 activations of <= 128.
// Per-32 activations only (act_bits 0).
#pragma once
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "common/act_q8.h"

namespace torch_lowbit {

constexpr int64_t kI8TileRows = 16;
constexpr int kI8MaxTable = 256;  // 8-bit codes (q8_0); 16 codebooks x 8 entries (gcb3) need 128

struct LutI8Weights {
  const uint8_t* qweight;   // [N/16, K/32, 64 * bits]
  const c10::Half* scales;  // [N/16, K/group, 16]
  const c10::Half* mins;    // same, or nullptr
  const uint8_t* sub_groups;  // gcb: [N/16, K/32, 16] (codebook << 4 | sub-scale), else nullptr
  uint8_t utable[kI8MaxTable];  // table + offset, all in 0..255 (unused entries 0)
  int32_t offset;
  int64_t N, K, group;
  const float* bias;         // [N] fp32 or nullptr: accumulators start from it (bias fused)
  int bits;                  // code width, 1..6 or 8
  bool pairs = false;        // 2-D codebook: block b reads code block b / 2 through table b % 2
  const int8_t* sub_scales = nullptr;  // K-quants: [N/16, K/sub_block, 16] integer sub-block scales
  const uint8_t* sub_mins = nullptr;   // K-quants with mins: the same shape, or nullptr
  int sub_block = 32;                  // features per sub-scale: 16 or 32
};

// The 16 rows' sub-scales (and sub-mins) of sub-block j of tile t (K-quants).
inline int64_t lut_i8_sub_index(const LutI8Weights& w, int64_t t, int64_t j) {
  return (t * (w.K / w.sub_block) + j) * kI8TileRows;
}

inline int64_t lut_i8_block_bytes(int bits) { return 64 * bits; }

// Weight bytes the x86 kernels prefetch ahead of the block being decoded, per tile stream: the hardware
// prefetchers stop at 4 KiB pages, which a tile's 4-16 KiB of codes cross every few blocks. One
// thread streaming int2_g64 from DRAM (AVX-512): 606 µs without, 438-459 µs with 2-4 KiB ahead (4096²).
constexpr int64_t kPrefetchBytes = 4096;

// Code blocks per tile row (K / 32, or K / 64 for pairs).
inline int64_t lut_i8_code_blocks(const LutI8Weights& w) { return w.K / (w.pairs ? 64 : 32); }

// The codes of (tile t, block b): code block b / 2 for pairs.
inline const uint8_t* lut_i8_block(const LutI8Weights& w, int64_t t, int64_t b) {
  return w.qweight + (t * lut_i8_code_blocks(w) + (w.pairs ? b / 2 : b)) * lut_i8_block_bytes(w.bits);
}

// Where block b's table starts in utable: the second coordinate's table for odd blocks of pairs.
inline int lut_i8_table_base(const LutI8Weights& w, int64_t b) { return w.pairs && (b & 1) ? 1 << w.bits : 0; }


// Row r's code k (< 32) of the (tile, block) whose bytes start at p: the layout's definition.
inline int lut_i8_code(const uint8_t* p, int bits, int r, int k) {
  const int qd = k / 4, j = k % 4;
  auto field = [&](const uint8_t* plane, int w) {
    return (plane[(qd % w) * 64 + r * 4 + j] >> (w * (qd / w))) & ((1 << w) - 1);
  };
  if (bits == 3) return field(p, 2) | (field(p + 128, 1) << 2);
  if (bits == 5 || bits == 6) return field(p, 4) | (field(p + 256, bits - 4) << 4);
  return field(p, bits);
}

// Row r's unsigned table byte for code k of the (tile, block) at p; sub = that block's 16 sub-group
// bytes (gcb) or nullptr; base = lut_i8_table_base (pairs).
inline int lut_i8_value(const LutI8Weights& w, const uint8_t* p, const uint8_t* sub, int r, int k, int base) {
  const int code = lut_i8_code(p, w.bits, r, k);
  return w.utable[sub ? ((sub[r] >> 4) << w.bits) | code : base + code];
}

// Row r's factor for a block's isum: xd, times the sub-scale for gcb.
inline float lut_i8_block_factor(const uint8_t* sub, int r, float xd) {
  return sub ? static_cast<float>(sub[r] & 15) * xd : xd;
}

// Calls f(std::integral_constant<int, B>{}) with B = bits (1..6, 8), so kernels specialize on the width.
template <typename F>
inline void with_code_bits(int bits, F&& f) {
  switch (bits) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// Calls f(B, SUB, MINS) as std::integral_constant / std::bool_constant for a sub-scaled (K-quant) weight
// whose code width is one of the K-quants' (2..6), so SIMD kernels specialize on all three; false for
// other widths (the caller runs the scalar path).
template <typename F>
inline bool with_sub_scaled(const LutI8Weights& w, F&& f) {
  auto by_sub = [&](auto b) {
    if (w.sub_block == 16) {
      if (w.sub_mins) return f(b, std::integral_constant<int, 16>{}, std::true_type{});
      return f(b, std::integral_constant<int, 16>{}, std::false_type{});
    }
    if (w.sub_mins) return f(b, std::integral_constant<int, 32>{}, std::true_type{});
    return f(b, std::integral_constant<int, 32>{}, std::false_type{});
  };
  switch (w.bits) {
    case 2: by_sub(std::integral_constant<int, 2>{}); return true;
    case 3: by_sub(std::integral_constant<int, 3>{}); return true;
    case 4: by_sub(std::integral_constant<int, 4>{}); return true;
    case 5: by_sub(std::integral_constant<int, 5>{}); return true;
    case 6: by_sub(std::integral_constant<int, 6>{}); return true;
    default: return false;
  }
}

// out[m * ldo + n] for tiles [t0, t1) and all tokens of `a`.
using LutI8Fn = void (*)(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out,
                         int64_t ldo);

void lut_i8_scalar(const LutI8Weights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);
#if defined(TORCH_LOWBIT_X86)
void lut_i8_avx512vnni(const LutI8Weights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);
void lut_i8_avx512vbmi(const LutI8Weights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);  // gcb tables
void lut_i8_avx2(const LutI8Weights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);
void lut_i8_avxvnni(const LutI8Weights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);
void lut_i8_avxvnni_evex(const LutI8Weights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);  // AVX512-VNNI + VL
#endif
#if defined(__aarch64__)
void lut_i8_neon(const LutI8Weights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);     // csrc/arm
void lut_i8_dotprod(const LutI8Weights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);  // Armv8.2 sdot
#endif

}  // namespace torch_lowbit
