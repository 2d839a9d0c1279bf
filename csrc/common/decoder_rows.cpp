// The baseline builds of the decoder's row-wise pieces and the choice of build by ISA path.
#include "common/decoder_rows.h"

#include "common/decoder_rows_impl.h"
#include "common/dispatch.h"

namespace torch_lowbit {

TLB_DECODER_ROWS(scalar)

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
