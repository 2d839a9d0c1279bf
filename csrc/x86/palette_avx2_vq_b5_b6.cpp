// The AVX2 fused GEMV of 2-D codebooks with 5- and 6-bit codes (vq2.5, vq3) (palette_avx2_codebook.h)
#if defined(TORCH_LOWBIT_X86)
#include "x86/palette_avx2_codebook.h"

template bool torch_lowbit::palette_avx2::codebook_gemv_part<2, 5, 6>(const torch_lowbit::CodebookWeights&,
                                                                  const float*, int64_t, int64_t, int64_t, float*);
#endif
