// The AVX2 fused GEMV of 2-D codebooks with 9- and 10-bit codes (vq4.5, vq5) (palette_avx2_codebook.h)
#if defined(TORCH_LOWBIT_X86)
#include "x86/palette_avx2_codebook.h"

namespace torch_lowbit {
namespace palette_avx2 {

bool codebook_gemv_vq_b9_b10(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1, float* out) {
  switch (w.dim * 16 + w.code_bits) {
    case 2 * 16 + 9: codebook_gemv_rows<2, 9>(w, acts, M, n0, n1, out); return true;
    case 2 * 16 + 10: codebook_gemv_rows<2, 10>(w, acts, M, n0, n1, out); return true;
    default: return false;
  }
}

}  // namespace palette_avx2
}  // namespace torch_lowbit
#endif
