// ARM dotprod kernel of the q4_{R}x4 layouts (llama.cpp's Q4_0_4_4 and its 8-row twin): one 16-byte
// load holds 4 codes of 4 rows, so sdot by lane (the activation quad of that byte position) adds 4
// products to each row's lane; no horizontal sums. Whole file compiled for Armv8.2-a+dotprod; the op
// calls it only where HWCAP_ASIMDDP says the CPU has it.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <type_traits>

#include "common/q4x.h"  // before the target pragma: shared inline code stays plain Armv8-a

#pragma GCC target("arch=armv8.2-a+dotprod")
#include "arm/q4x_neon.h"

namespace torch_lowbit {
namespace {

template <bool TOGGLED, int R, int C>
inline void byte_quad(const uint8_t* p, int8x16_t table, int8x16_t x0, int8x16_t x1, int32x4_t* s) {
  for (int q = 0; q < R / 4; ++q) {  // chunk C (bytes 4C .. 4C+3) of rows 4q .. 4q+3
    int8x16_t lo, hi;
    split_nibbles<TOGGLED>(vld1q_u8(p + (C * R + 4 * q) * 4), table, lo, hi);
    s[q] = vdotq_laneq_s32(s[q], lo, x0, C);  // codes 4C + j against x[4C + j]
    s[q] = vdotq_laneq_s32(s[q], hi, x1, C);  // codes 16 + 4C + j against x[16 + 4C + j]
  }
}

template <bool TOGGLED, int R>
void kernel(const Q4xWeights& w, const Q8Acts& a, int64_t g0, int64_t g1, float* out, int64_t ldo) {
  constexpr int Q = R / 4;
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  const int8x16_t table = vld1q_s8(w.table);
  for (int64_t rg = g0; rg < g1; ++rg)
    for (int64_t m = 0; m < a.M; ++m) {
      TokenAcc<Q> t;
      t.start(w, rg);
      for (int64_t g = 0; g < groups; ++g) {
        t.start_group();
        for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
          const uint8_t* p = w.qweight + (rg * kb_count + b) * 16 * R;
          const int8_t* xq = a.q + m * a.K + b * 32;
          const int8x16_t x0 = vld1q_s8(xq), x1 = vld1q_s8(xq + 16);
          int32x4_t s[Q];
          for (int q = 0; q < Q; ++q) s[q] = vdupq_n_s32(0);
          byte_quad<TOGGLED, R, 0>(p, table, x0, x1, s);
          byte_quad<TOGGLED, R, 1>(p, table, x0, x1, s);
          byte_quad<TOGGLED, R, 2>(p, table, x0, x1, s);
          byte_quad<TOGGLED, R, 3>(p, table, x0, x1, s);
          for (int q = 0; q < Q; ++q) t.add_block(q, TOGGLED ? vshrq_n_s32(s[q], 4) : s[q], a, a.d[m * kb_count + b]);
        }
        t.end_group(w, a, m, rg, g);
      }
      t.store(w, rg, out + m * ldo);
    }
}

}  // namespace

void q4x_dotprod(const Q4xWeights& w, const Q8Acts& a, int64_t g0, int64_t g1, float* out, int64_t ldo) {
  if (w.chunk != 4) return q4x_scalar(w, a, g0, g1, out, ldo);
  with_q4x_form(w, [&](auto toggled, auto rows) { kernel<decltype(toggled)::value, decltype(rows)::value>(w, a, g0, g1, out, ldo); });
}

}  // namespace torch_lowbit
#endif  // __aarch64__
