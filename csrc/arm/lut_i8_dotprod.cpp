// ARM dotprod kernel (Armv8.2-a+dotprod: Neoverse N1 and later, Cortex-A76+, Apple M1+) for the
// int8-tile layouts: the kernel of lut_i8_neon_kernel.h with sdot by lane. The whole file is
// compiled for that ISA; lut_i8_linear calls it only where HWCAP_ASIMDDP says the CPU has it.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>

#include "common/lut_i8.h"  // before the target pragma: shared inline code stays plain Armv8-a

// The rest of the file is dotprod code, lut_i8_neon_kernel.h's templates included (internal linkage).
#pragma GCC target("arch=armv8.2-a+dotprod")
#include "arm/lut_i8_neon_kernel.h"

namespace torch_lowbit {
namespace {

struct DotprodDot {
  template <int LANE>
  static int32x4_t dot(int32x4_t acc, int8x16_t vals, int8x16_t x) { return vdotq_laneq_s32(acc, vals, x, LANE); }
};

}  // namespace

void lut_i8_dotprod(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  lut_i8_neon_tiles<DotprodDot>(w, a, t0, t1, out, ldo);
}

}  // namespace torch_lowbit
#endif  // __aarch64__
