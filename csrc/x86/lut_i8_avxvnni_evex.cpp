// The avxvnni kernel for CPUs with AVX512-VNNI but no AVX-VNNI (Cascade Lake, Ice Lake, AMD Zen 4): the
// same 256-bit tile kernel (x86/lut_i8_avx2_kernel.h), its vpdpbusd on ymm EVEX-encoded (AVX512-VL).
// The avx512 path runs it for row-codebook tables on CPUs without VBMI, and on AVX-512 machines the
// avxvnni path's tests run the Vnni dot's code through it.
#if defined(TORCH_LOWBIT_X86)
#define TLB_KERNEL __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define TLB_DPBUSD_YMM _mm256_dpbusd_epi32
#include "x86/lut_i8_avx2_kernel.h"

namespace torch_lowbit {

TLB_KERNEL void lut_i8_avxvnni_evex(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out,
                                    int64_t ldo) {
  with_code_bits(w.bits, [&](auto b) TLB_KERNEL { run_range<Dot::Vnni, decltype(b)::value>(w, a, t0, t1, out, ldo); });
}

}  // namespace torch_lowbit
#endif
