// Portable lut x int8 kernel: the path the SIMD paths are checked against bit for bit.
#include <algorithm>
#include <cmath>

#include "common/lut_i8.h"

namespace torch_lowbit {
namespace {

// Integer sub-scales (K-quants, lut_i8.h): each block's sub-block sums weighted in int32.
void sub_scaled_scalar(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  const int subs = 32 / w.sub_block;  // sub-blocks per block: 1 or 2
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t rows = std::min(kI8TileRows, w.N - t * kI8TileRows);
    for (int64_t m = 0; m < a.M; ++m) {
      float acc[kI8TileRows] = {0};
      for (int64_t r = 0; r < rows && w.bias; ++r) acc[r] = w.bias[t * kI8TileRows + r];
      for (int64_t g = 0; g < groups; ++g) {
        float gacc[kI8TileRows] = {0}, macc[kI8TileRows] = {0};
        for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
          const int64_t b = g * blocks_per_group + bb;
          const uint8_t* p = lut_i8_block(w, t, b);
          const int8_t* xq = a.q + m * a.K + b * 32;
          const float xd = a.d[m * kb_count + b];
          for (int r = 0; r < kI8TileRows; ++r) {
            int32_t isum = 0, msum = 0;
            for (int h = 0; h < subs; ++h) {
              const int32_t xsum = subs == 1 ? a.sum[m * kb_count + b] : a.half_sum[m * 2 * kb_count + 2 * b + h];
              int32_t dot = 0;
              for (int k = h * w.sub_block; k < (h + 1) * w.sub_block; ++k) dot += w.utable[lut_i8_code(p, w.bits, r, k)] * xq[k];
              const int64_t s = lut_i8_sub_index(w, t, b * subs + h) + r;
              isum += w.sub_scales[s] * (dot - w.offset * xsum);
              if (w.sub_mins) msum += w.sub_mins[s] * xsum;
            }
            gacc[r] = std::fma(static_cast<float>(isum), xd, gacc[r]);
            macc[r] = std::fma(static_cast<float>(msum), xd, macc[r]);
          }
        }
        for (int r = 0; r < kI8TileRows; ++r) {
          const int64_t pidx = (t * groups + g) * kI8TileRows + r;
          acc[r] = std::fma(gacc[r], static_cast<float>(w.scales[pidx]), acc[r]);
          if (w.mins) acc[r] = std::fma(static_cast<float>(w.mins[pidx]), macc[r], acc[r]);
        }
      }
      for (int64_t r = 0; r < rows; ++r) out[m * ldo + t * kI8TileRows + r] = acc[r];
    }
  }
}

}  // namespace

void lut_i8_scalar(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  if (w.sub_scales) return sub_scaled_scalar(w, a, t0, t1, out, ldo);
  const int64_t kb_count = w.K / 32, groups = w.K / w.group, blocks_per_group = w.group / 32;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t rows = std::min(kI8TileRows, w.N - t * kI8TileRows);
    for (int64_t m = 0; m < a.M; ++m) {
      float acc[kI8TileRows] = {0};
      for (int64_t r = 0; r < rows && w.bias; ++r) acc[r] = w.bias[t * kI8TileRows + r];
      for (int64_t g = 0; g < groups; ++g) {
        float gacc[kI8TileRows] = {0};
        int32_t gisum[kI8TileRows] = {0};  // per-token activations: the group's integer sum
        for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
          const int64_t b = g * blocks_per_group + bb;
          const uint8_t* p = lut_i8_block(w, t, b);
          const int base = lut_i8_table_base(w, b);
          const int8_t* xq = a.q + m * a.K + b * 32;
          const int32_t xsum = a.sum[m * kb_count + b];
          const float xd = a.d[m * kb_count + b];
          const uint8_t* sub = w.sub_groups ? w.sub_groups + (t * kb_count + b) * kI8TileRows : nullptr;
          for (int r = 0; r < kI8TileRows; ++r) {
            int32_t isum = 0;
            for (int k = 0; k < 32; ++k) isum += lut_i8_value(w, p, sub, r, k, base) * xq[k];
            isum -= w.offset * xsum;
            if (a.per_token)
              gisum[r] += isum;
            else
              gacc[r] = std::fma(static_cast<float>(isum), lut_i8_block_factor(sub, r, xd), gacc[r]);
          }
        }
        for (int r = 0; r < kI8TileRows; ++r) {
          if (a.per_token) gacc[r] = static_cast<float>(gisum[r]) * a.d[m * kb_count];
          const int64_t pidx = (t * groups + g) * kI8TileRows + r;
          acc[r] = std::fma(gacc[r], static_cast<float>(w.scales[pidx]), acc[r]);
          if (w.mins) acc[r] = std::fma(static_cast<float>(w.mins[pidx]), a.group_dsum[m * groups + g], acc[r]);
        }
      }
      for (int64_t r = 0; r < rows; ++r) out[m * ldo + t * kI8TileRows + r] = acc[r];
    }
  }
}

}  // namespace torch_lowbit
