// The avxvnni TCQ GEMV for CPUs with AVX512-VNNI but no AVX-VNNI (Cascade Lake, Ice Lake, AMD Zen 4):
// x86/palette_avx2_tcq.h with its vpdpbusd on ymm EVEX-encoded (AVX512-VL), as lut_i8_avxvnni_evex.cpp.
#if defined(TORCH_LOWBIT_X86)
#define TLB_TCQ_KERNEL __attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni")))
#define TLB_DPBUSD_YMM _mm256_dpbusd_epi32
#include "x86/palette_avx2_tcq.h"

namespace torch_lowbit {

void tcq_gemv_avxvnni_evex(const TcqWeights& w, const float* x, int64_t M, int64_t b0, int64_t b1, float* out) {
  palette_avx2::tcq_gemv_kernel(w, x, M, b0, b1, out);
}

}  // namespace torch_lowbit
#endif
