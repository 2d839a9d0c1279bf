// The AVX2 fused GEMV of 2-D codebooks with 3- and 4-bit codes (vq1.5, vq2) (palette_avx2_codebook.h)
#if defined(TORCH_LOWBIT_X86)
#include "x86/palette_avx2_codebook.h"

template bool torch_lowbit::palette_avx2::codebook_gemv_part<2, 3, 4>(const torch_lowbit::CodebookWeights&,
                                                                  const float*, int64_t, int64_t, int64_t, float*);
#endif
