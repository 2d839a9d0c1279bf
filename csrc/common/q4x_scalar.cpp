// Portable kernel of the interleaved q4_{R}x{S} layouts: the reference the ARM paths are checked against.
#include <algorithm>
#include <cmath>

#include "common/q4x.h"

namespace torch_lowbit {

void q4x_scalar(const Q4xWeights& w, const Q8Acts& a, int64_t g0, int64_t g1, float* out, int64_t ldo) {
  const int R = w.rows;
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  for (int64_t rg = g0; rg < g1; ++rg) {
    const int64_t rows = std::min<int64_t>(R, w.N - rg * R);
    for (int64_t m = 0; m < a.M; ++m) {
      float acc[8] = {0};
      for (int64_t r = 0; r < rows && w.bias; ++r) acc[r] = w.bias[rg * R + r];
      for (int64_t g = 0; g < groups; ++g) {
        float gacc[8] = {0};
        int32_t gisum[8] = {0};
        for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
          const uint8_t* p = w.qweight + (rg * kb_count + b) * 16 * R;
          const int8_t* xq = a.q + m * a.K + b * 32;
          for (int r = 0; r < R; ++r) {
            int32_t isum = 0;
            for (int k = 0; k < 32; ++k) isum += w.table[q4x_code(p, R, w.chunk, w.toggled, r, k)] * xq[k];
            if (a.per_token)
              gisum[r] += isum;
            else
              gacc[r] = std::fma(static_cast<float>(isum), a.d[m * kb_count + b], gacc[r]);
          }
        }
        for (int r = 0; r < R; ++r) {
          if (a.per_token) gacc[r] = static_cast<float>(gisum[r]) * a.d[m * kb_count];
          acc[r] = std::fma(gacc[r], static_cast<float>(w.scales[(rg * groups + g) * R + r]), acc[r]);
        }
      }
      for (int64_t r = 0; r < rows; ++r) out[m * ldo + rg * R + r] = acc[r];
    }
  }
}

}  // namespace torch_lowbit
