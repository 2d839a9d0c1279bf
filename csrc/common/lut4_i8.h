// Kernels for lut4 formats with integer code values (q4_0, int4_g*, iq4_nl) over int8 activations.
//
// Layout "lut4_i8_n16" (torch_lowbit/layouts/lut4_i8.py packs it): rows in tiles of 16 (N padded),
// K in blocks of 32. qweight [N/16, K/32, 256] uint8: the 256 bytes of (tile, block) are 4 chunks
// of 64; byte r*4 + j of chunk i holds, for row r of the tile, code k = 4i + j in its low nibble
// and code k = 16 + 4i + j in its high nibble. So one 64-byte load gives, per 32-bit lane, the 4
// consecutive codes of one row: vpdpbusd against 4 broadcast activations accumulates 16 rows at
// once, with no horizontal reduction. scales/mins [N/16, K/group, 16] fp16 (16 rows contiguous).
//
// Integer math per (row, 32-block): isum = sum_j u[code_j] * xq_j - offset * sum_j xq_j, where
// u = table + offset >= 0 (vpdpbusd multiplies unsigned by signed bytes); then
// acc = fma(float(isum), scale * xd, acc) and, with mins, acc = fma(min, xd * float(sum xq), acc).
// Accumulators start at the bias (0 without one). Every path performs exactly these operations in
// this order, so all paths agree bit for bit.
#pragma once
#include <c10/util/Half.h>

#include <cstdint>

#include "common/act_q8.h"

namespace torch_lowbit {

constexpr int64_t kI8TileRows = 16;

struct Lut4I8Weights {
  const uint8_t* qweight;   // [N/16, K/32, 256]
  const c10::Half* scales;  // [N/16, K/group, 16]
  const c10::Half* mins;    // same, or nullptr
  uint8_t utable[16];       // table + offset, all in 0..255
  int32_t offset;
  int64_t N, K, group;
  const float* bias;         // [N] fp32 or nullptr: accumulators start from it (bias fused)
};

// out[m * ldo + n] for tiles [t0, t1) and all tokens of `a`.
using Lut4I8Fn = void (*)(const Lut4I8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out,
                          int64_t ldo);

void lut4_i8_scalar(const Lut4I8Weights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);
#if defined(TORCH_LOWBIT_X86)
void lut4_i8_avx512vnni(const Lut4I8Weights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);
void lut4_i8_avx2(const Lut4I8Weights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);
#endif

}  // namespace torch_lowbit
