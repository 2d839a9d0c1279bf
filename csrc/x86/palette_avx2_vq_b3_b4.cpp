// The AVX2 fused GEMV of 2-D codebooks with 3- and 4-bit codes (vq1.5, vq2) (palette_avx2_codebook.h)
#if defined(TORCH_LOWBIT_X86)
#include "x86/palette_avx2_codebook.h"

namespace torch_lowbit {
namespace palette_avx2 {

bool codebook_gemv_vq_b3_b4(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1, float* out) {
  switch (w.dim * 16 + w.code_bits) {
    case 2 * 16 + 3: codebook_gemv_rows<2, 3>(w, acts, M, n0, n1, out); return true;
    case 2 * 16 + 4: codebook_gemv_rows<2, 4>(w, acts, M, n0, n1, out); return true;
    default: return false;
  }
}

}  // namespace palette_avx2
}  // namespace torch_lowbit
#endif
