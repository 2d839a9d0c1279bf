// The AVX2 fused GEMV of 2-D codebooks with 9- and 10-bit codes (vq4.5, vq5) (palette_avx2_codebook.h)
#if defined(TORCH_LOWBIT_X86)
#include "x86/palette_avx2_codebook.h"

template bool torch_lowbit::palette_avx2::codebook_gemv_part<2, 9, 10>(const torch_lowbit::CodebookWeights&,
                                                                  const float*, int64_t, int64_t, int64_t, float*);
#endif
