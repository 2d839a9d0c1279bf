// The TCQ GEMV (x86/palette_avx2_tcq.h) with the 1mad code's byte sums as vpdpbusd on ymm (AVX-VNNI:
// Intel Alder Lake and later client CPUs, Sapphire Rapids, AMD Zen 5): two of the loop's eight
// multiply-pipe operations per 16 weights fewer than vpmaddubsw + vpmaddwd.
#if defined(TORCH_LOWBIT_X86)
#define TLB_TCQ_KERNEL __attribute__((target("avx2,fma,avxvnni")))
#define TLB_DPBUSD_YMM _mm256_dpbusd_avx_epi32
#include "x86/palette_avx2_tcq.h"

namespace torch_lowbit {

void tcq_gemv_avxvnni(const TcqWeights& w, const float* x, int64_t M, int64_t b0, int64_t b1, float* out) {
  palette_avx2::tcq_gemv_kernel(w, x, M, b0, b1, out);
}

}  // namespace torch_lowbit
#endif
