// AVX-VNNI lut x int8 kernel: the AVX2 tile kernel (x86/lut_i8_avx2_kernel.h) with vpdpbusd on ymm
// (Intel Alder Lake and later client CPUs, Sapphire Rapids, AMD Zen 5) for the products: unsigned
// table bytes times signed activations, 4 per int32 lane, no saturation to avoid.
#if defined(TORCH_LOWBIT_X86)
#define TLB_KERNEL __attribute__((target("avx2,fma,f16c,avxvnni")))
#include "x86/lut_i8_avx2_kernel.h"

namespace torch_lowbit {

TLB_KERNEL void lut_i8_avxvnni(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out,
                              int64_t ldo) {
  with_code_bits(w.bits, [&](auto b) TLB_KERNEL { run_range<Dot::Vnni, decltype(b)::value>(w, a, t0, t1, out, ldo); });
}

}  // namespace torch_lowbit
#endif
