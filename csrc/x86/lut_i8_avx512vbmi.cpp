// AVX-512 VNNI + VBMI lut x int8 kernel for the group codebooks (gcb2: the 16 codebooks of 4 entries
// in one register, vpermb; gcb3: 16 x 8 entries in two, vpermi2b); the tile kernel itself is
// x86/lut_i8_avx512_kernel.h.
#if defined(TORCH_LOWBIT_X86)
#define TLB_KERNEL __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c,fma")))
#include "x86/lut_i8_avx512_kernel.h"

namespace torch_lowbit {

TLB_KERNEL void lut_i8_avx512vbmi(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out,
                                 int64_t ldo) {
  if (w.bits == 2)
    run_range<Lookup::RowCodebook, 2>(w, a, t0, t1, out, ldo);
  else
    run_range<Lookup::RowCodebook, 3>(w, a, t0, t1, out, ldo);
}

}  // namespace torch_lowbit
#endif
