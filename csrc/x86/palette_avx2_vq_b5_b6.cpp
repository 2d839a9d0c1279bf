// The AVX2 fused GEMV of 2-D codebooks with 5- and 6-bit codes (vq2.5, vq3) (palette_avx2_codebook.h)
#if defined(TORCH_LOWBIT_X86)
#include "x86/palette_avx2_codebook.h"

namespace torch_lowbit {
namespace palette_avx2 {

bool codebook_gemv_vq_b5_b6(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1, float* out) {
  switch (w.dim * 16 + w.code_bits) {
    case 2 * 16 + 5: codebook_gemv_rows<2, 5>(w, acts, M, n0, n1, out); return true;
    case 2 * 16 + 6: codebook_gemv_rows<2, 6>(w, acts, M, n0, n1, out); return true;
    default: return false;
  }
}

}  // namespace palette_avx2
}  // namespace torch_lowbit
#endif
