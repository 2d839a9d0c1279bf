// The baseline build of one attention row and the choice of build by ISA path.
#include "common/attention_row.h"

#include "common/attention_row_impl.h"
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

AttendRowFn attend_row_kernel() {
#if defined(TORCH_LOWBIT_X86)
  switch (kernel_isa(active_cpu_path())) {
    case CpuPath::Avx512: return attend_row_avx512;
    case CpuPath::Avx2: return attend_row_avx2;
    default: break;
  }
#endif
  return attend_row_scalar;
}

}  // namespace torch_lowbit

namespace torch_lowbit {

AttendGroupFn attend_group_kernel() {
#if defined(TORCH_LOWBIT_X86)
  switch (kernel_isa(active_cpu_path())) {
    case CpuPath::Avx512: return attend_group_avx512;
    case CpuPath::Avx2: return attend_group_avx2;
    default: break;
  }
#endif
  return attend_group_scalar;
}

}  // namespace torch_lowbit
