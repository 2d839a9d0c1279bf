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

TLB_DECODER_ROWS(avx512)

}  // namespace torch_lowbit

#pragma GCC pop_options
#endif
