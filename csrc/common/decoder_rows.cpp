// The baseline builds of the decoder's row-wise pieces and the choice of build by ISA path.
#include "common/decoder_rows.h"

#include "common/decoder_rows_impl.h"
#include "common/dispatch.h"

namespace torch_lowbit {

void attend_row_scalar(const float* q, const float* k, const float* v, int64_t stride, int64_t L, int64_t D,
                       float scale, const float* mask, int64_t mask_stride, float* p, float* out) {
  attend_row_impl(q, k, v, stride, L, D, scale, mask, mask_stride, p, out);
}

void attend_group_scalar(const float* q, int64_t G, const float* k, const float* v, int64_t stride, int64_t L,
                         int64_t D, float scale, float* p, float* out) {
  attend_group_impl(q, G, k, v, stride, L, D, scale, p, out);
}

void silu_mul_scalar(const float* g, const float* u, int64_t n, float* out) { silu_mul_impl(g, u, n, out); }

namespace {
// The build of the active ISA path among (scalar, avx2, avx512).
template <typename Fn>
Fn for_path(Fn scalar, Fn avx2, Fn avx512) {
  switch (kernel_isa(active_cpu_path())) {
    case CpuPath::Avx512: return avx512;
    case CpuPath::Avx2: return avx2;
    default: return scalar;
  }
}
}  // namespace

#if defined(TORCH_LOWBIT_X86)
AttendRowFn attend_row_kernel() { return for_path(attend_row_scalar, attend_row_avx2, attend_row_avx512); }
AttendGroupFn attend_group_kernel() { return for_path(attend_group_scalar, attend_group_avx2, attend_group_avx512); }
SiluMulFn silu_mul_kernel() { return for_path(silu_mul_scalar, silu_mul_avx2, silu_mul_avx512); }
#else
AttendRowFn attend_row_kernel() { return attend_row_scalar; }
AttendGroupFn attend_group_kernel() { return attend_group_scalar; }
SiluMulFn silu_mul_kernel() { return silu_mul_scalar; }
#endif

}  // namespace torch_lowbit
