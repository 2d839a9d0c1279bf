// The AVX2 fused GEMV of the scalar codebooks: nuq1..nuq4 (one weight per code) (palette_avx2_codebook.h)
#if defined(TORCH_LOWBIT_X86)
#include "x86/palette_avx2_codebook.h"

namespace torch_lowbit {
namespace palette_avx2 {

bool codebook_gemv_nuq(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1, float* out) {
  switch (w.dim * 16 + w.code_bits) {
    case 1 * 16 + 1: codebook_gemv_rows<1, 1>(w, acts, M, n0, n1, out); return true;
    case 1 * 16 + 2: codebook_gemv_rows<1, 2>(w, acts, M, n0, n1, out); return true;
    case 1 * 16 + 3: codebook_gemv_rows<1, 3>(w, acts, M, n0, n1, out); return true;
    case 1 * 16 + 4: codebook_gemv_rows<1, 4>(w, acts, M, n0, n1, out); return true;
    default: return false;
  }
}

}  // namespace palette_avx2
}  // namespace torch_lowbit
#endif
