// Interleaved 4-bit layouts for ARM (issue #22, the seed paper's SIMD-aware weight interleaving and
// llama.cpp's Q4_0_4_4 / Q4_0_4_8 / Q4_0_8_8): layouts "q4_{R}x{S}" (torch_lowbit/layouts/q4x.py
// packs them) for 4-bit formats with an int8 table and no mins (q4_0, iq4_nl, int4_pc).
//
// Rows in groups of R (4 or 8; N padded), K in blocks of 32. qweight [N/R, K/32, 16 R] uint8: the 16
// "qs" bytes of each row's block (ggml's order: byte j = code j | code j + 16 << 4) are cut into
// chunks of S bytes (4 or 8) and the R rows' chunks interleaved: chunk i of the block's 16 R bytes is
// row i % R's bytes (i / R) S .. (i / R) S + S - 1. So one 16-byte load holds 4 codes of 4 rows
// (S = 4: sdot by lane) or 8 codes of 2 rows (S = 8: the 2x8 operand of smmla). Tables c - 8 (q4_0,
// int4_pc) are stored with each nibble's top bit toggled (c ^ 8: the signed 4-bit value t = c - 8 in
// two's complement, the seed's trick), so a kernel gets t * 16 from one shift or mask per byte and
// needs no table; other tables (iq4_nl) keep the codes and look them up (tbl). scales
// [N/R, K/group, R] fp16.
//
// Math: exactly lut_i8's (common/lut_i8.h) with u = t, offset 0: per (row, block) isum = sum t x_q,
// gacc = fma(float(isum), xd, gacc), per group acc = fma(gacc, scale, acc); per-token activations:
// the group's isums in int32, gacc = float(isum_group) * xd. So these layouts give the bytes the
// lut{4}_i8_n16 kernels give for the same weights, on every path.
#pragma once
#include <c10/util/Half.h>

#include <cstdint>

#include "common/act_q8.h"

namespace torch_lowbit {

struct Q4xWeights {
  const uint8_t* qweight;   // [N/R, K/32, 16 R]
  const c10::Half* scales;  // [N/R, K/group, R]
  int8_t table[16];         // value of each code
  bool toggled;             // nibbles stored as c ^ 8 (table c - 8)
  int rows, chunk;          // R (4, 8), S (4, 8)
  int64_t N, K, group;
  const float* bias;        // [N] or nullptr
};

// Row r's (r < R) code k (< 32) of the (row group, block) whose 16 R bytes start at p.
inline int q4x_code(const uint8_t* p, int rows, int chunk, bool toggled, int r, int k) {
  const int byte = k % 16, c = (byte / chunk) * rows + r;
  const int nibble = (p[c * chunk + byte % chunk] >> (k < 16 ? 0 : 4)) & 15;
  return toggled ? nibble ^ 8 : nibble;
}

// out[m * ldo + n] for row groups [g0, g1) and all tokens of `a`.
using Q4xFn = void (*)(const Q4xWeights& w, const Q8Acts& a, int64_t g0, int64_t g1, float* out, int64_t ldo);

void q4x_scalar(const Q4xWeights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);
#if defined(__aarch64__)
void q4x_dotprod(const Q4xWeights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);  // S = 4: sdot by lane
void q4x_i8mm(const Q4xWeights&, const Q8Acts&, int64_t, int64_t, float*, int64_t);     // S = 8: smmla
#endif

}  // namespace torch_lowbit
