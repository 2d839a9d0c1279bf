// One attention row and one GQA group of rows (common/attention_row_impl.h) compiled for AVX2 + FMA:
// its dot products, exponentials and weighted sums vectorize to that width.
#if defined(TORCH_LOWBIT_X86)
#include <algorithm>
#include <cstring>
#include <limits>

#include "common/attention_row.h"  // before the target pragma: shared inline code stays baseline x86-64

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "common/attention_row_impl.h"

namespace torch_lowbit {

void attend_row_avx2(const float* q, const float* k, const float* v, int64_t stride, int64_t L, int64_t D,
                     float scale, const float* mask, int64_t mask_stride, float* p, float* out) {
  attend_row_impl(q, k, v, stride, L, D, scale, mask, mask_stride, p, out);
}

void attend_group_avx2(const float* q, int64_t G, const float* k, const float* v, int64_t stride, int64_t L,
                       int64_t D, float scale, float* p, float* out) {
  attend_group_impl(q, G, k, v, stride, L, D, scale, p, out);
}

}  // namespace torch_lowbit

#pragma GCC pop_options
#endif
