// ARM i8mm kernel of the q4_{R}x8 layouts (llama.cpp's Q4_0_4_8 and Q4_0_8_8): one 16-byte load holds 8
// codes of 2 rows, the 2x8 operand of smmla; two tokens' 8 activations are the other, so one smmla adds
// 16 products to each of 2 rows x 2 tokens. Tokens run in pairs; a single token (decode, an odd last one)
// runs sdot instead.
// Whole file compiled for Armv8.6-a+i8mm; the op calls it only where HWCAP2_I8MM says the CPU has it.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <type_traits>

#include "common/q4x.h"  // before the target pragma: shared inline code stays plain Armv8-a

#pragma GCC target("arch=armv8.6-a+i8mm")
#include "arm/q4x_neon.h"

namespace torch_lowbit {
namespace {

// A single token (decode, or the odd last one): smmla would waste half its products, so sdot (vector form)
// against the token's 8 activations twice: lanes (row 2j, codes 0-3), (2j, 4-7), (2j + 1, 0-3), (2j + 1, 4-7),
// pairwise-added per block into one lane per row.
template <bool TOGGLED, int R>
void single_token(const Q4xWeights& w, const Q8Acts& a, int64_t rg, int64_t m, float* out_row) {
  constexpr int P = R / 2, Q = R / 4;
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  const int8x16_t table = vld1q_s8(w.table);
  TokenAcc<Q> t;
  t.start(w, rg);
  for (int64_t g = 0; g < groups; ++g) {
    t.start_group();
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      const uint8_t* p = w.qweight + (rg * kb_count + b) * 16 * R;
      const int8_t* xa = a.q + m * a.K + b * 32;
      int8x16_t x[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) x[i] = vcombine_s8(vld1_s8(xa + 8 * i), vld1_s8(xa + 8 * i));
      int32x4_t s[P];
      for (int j = 0; j < P; ++j) s[j] = vdupq_n_s32(0);
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half)
#pragma GCC unroll 4
        for (int j = 0; j < P; ++j) {
          int8x16_t lo, hi;
          split_nibbles<TOGGLED>(vld1q_u8(p + (half * P + j) * 16), table, lo, hi);
          s[j] = vdotq_s32(s[j], lo, x[half]);
          s[j] = vdotq_s32(s[j], hi, x[2 + half]);
        }
#pragma GCC unroll 2
      for (int q = 0; q < Q; ++q) {
        const int32x4_t r = vpaddq_s32(s[2 * q], s[2 * q + 1]);  // rows 4q .. 4q+3
        t.add_block(q, TOGGLED ? vshrq_n_s32(r, 4) : r, a, a.d[m * kb_count + b]);
      }
    }
    t.end_group(w, a, m, rg, g);
  }
  t.store(w, rg, out_row);
}

template <bool TOGGLED, int R>
void kernel(const Q4xWeights& w, const Q8Acts& a, int64_t g0, int64_t g1, float* out, int64_t ldo) {
  constexpr int P = R / 2, Q = R / 4;  // row pairs, row quads
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  const int8x16_t table = vld1q_s8(w.table);
  for (int64_t rg = g0; rg < g1; ++rg)
    for (int64_t m = 0; m < a.M; m += 2) {
      if (m + 1 == a.M) {
        single_token<TOGGLED, R>(w, a, rg, m, out + m * ldo);
        break;
      }
      const int64_t m1 = m + 1;
      TokenAcc<Q> t0, t1;
      t0.start(w, rg);
      t1.start(w, rg);
      for (int64_t g = 0; g < groups; ++g) {
        t0.start_group();
        t1.start_group();
        for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
          const uint8_t* p = w.qweight + (rg * kb_count + b) * 16 * R;
          const int8_t* xa = a.q + m * a.K + b * 32;
          const int8_t* xb = a.q + m1 * a.K + b * 32;
          int8x16_t x[4];  // codes 8i .. 8i+7 of both tokens
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) x[i] = vcombine_s8(vld1_s8(xa + 8 * i), vld1_s8(xb + 8 * i));
          int32x4_t s[P];  // lanes: (row 2j, token 0), (2j, 1), (2j + 1, 0), (2j + 1, 1)
          for (int j = 0; j < P; ++j) s[j] = vdupq_n_s32(0);
#pragma GCC unroll 2
          for (int half = 0; half < 2; ++half)  // bytes 8 half .. 8 half + 7: codes 8 half + i and 16 + 8 half + i
#pragma GCC unroll 4
            for (int j = 0; j < P; ++j) {
              int8x16_t lo, hi;
              split_nibbles<TOGGLED>(vld1q_u8(p + (half * P + j) * 16), table, lo, hi);
              s[j] = vmmlaq_s32(s[j], lo, x[half]);
              s[j] = vmmlaq_s32(s[j], hi, x[2 + half]);
            }
#pragma GCC unroll 2
          for (int q = 0; q < Q; ++q) {  // rows 4q .. 4q+3 per token
            int32x4_t r0 = vuzp1q_s32(s[2 * q], s[2 * q + 1]), r1 = vuzp2q_s32(s[2 * q], s[2 * q + 1]);
            if (TOGGLED) {
              r0 = vshrq_n_s32(r0, 4);
              r1 = vshrq_n_s32(r1, 4);
            }
            t0.add_block(q, r0, a, a.d[m * kb_count + b]);
            t1.add_block(q, r1, a, a.d[m1 * kb_count + b]);
          }
        }
        t0.end_group(w, a, m, rg, g);
        t1.end_group(w, a, m1, rg, g);
      }
      t0.store(w, rg, out + m * ldo);
      t1.store(w, rg, out + m1 * ldo);
    }
}

}  // namespace

void q4x_i8mm(const Q4xWeights& w, const Q8Acts& a, int64_t g0, int64_t g1, float* out, int64_t ldo) {
  if (w.chunk != 8) return q4x_scalar(w, a, g0, g1, out, ldo);
  with_q4x_form(w, [&](auto toggled, auto rows) { kernel<decltype(toggled)::value, decltype(rows)::value>(w, a, g0, g1, out, ldo); });
}

}  // namespace torch_lowbit
#endif  // __aarch64__
