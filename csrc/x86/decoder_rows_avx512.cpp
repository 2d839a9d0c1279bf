// The decoder's row-wise pieces (common/decoder_rows_impl.h: attention rows, GQA groups, the SiLU gate)
// compiled for AVX-512: their dot products, exponentials and weighted sums vectorize to that width.
#if defined(TORCH_LOWBIT_X86)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/decoder_rows.h"  // before the target pragma: shared inline code stays baseline x86-64

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx2,fma")
#include "common/decoder_rows_impl.h"

namespace torch_lowbit {

void attend_row_avx512(const float* q, const float* k, const float* v, int64_t stride, int64_t L, int64_t D,
                     float scale, const float* mask, int64_t mask_stride, float* p, float* out) {
  attend_row_impl(q, k, v, stride, L, D, scale, mask, mask_stride, p, out);
}

void attend_group_avx512(const float* q, int64_t G, const float* k, const float* v, int64_t stride, int64_t L,
                       int64_t D, float scale, float* p, float* out) {
  attend_group_impl(q, G, k, v, stride, L, D, scale, p, out);
}

void silu_mul_avx512(const float* g, const float* u, int64_t n, float* out) { silu_mul_impl(g, u, n, out); }

}  // namespace torch_lowbit

#pragma GCC pop_options
#endif
