// The AVX2 fused GEMV of 2-D codebooks with 7- and 8-bit codes (vq3.5, vq4) (palette_avx2_codebook.h)
#if defined(TORCH_LOWBIT_X86)
#include "x86/palette_avx2_codebook.h"

namespace torch_lowbit {
namespace palette_avx2 {

bool codebook_gemv_vq_b7_b8(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1, float* out) {
  switch (w.dim * 16 + w.code_bits) {
    case 2 * 16 + 7: codebook_gemv_rows<2, 7>(w, acts, M, n0, n1, out); return true;
    case 2 * 16 + 8: codebook_gemv_rows<2, 8>(w, acts, M, n0, n1, out); return true;
    default: return false;
  }
}

}  // namespace palette_avx2
}  // namespace torch_lowbit
#endif
