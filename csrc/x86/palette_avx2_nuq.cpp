// The AVX2 fused GEMV of the scalar codebooks: nuq1..nuq4 (one weight per code) (palette_avx2_codebook.h)
#if defined(TORCH_LOWBIT_X86)
#include "x86/palette_avx2_codebook.h"

template bool torch_lowbit::palette_avx2::codebook_gemv_part<1, 1, 2, 3, 4>(const torch_lowbit::CodebookWeights&,
                                                                  const float*, int64_t, int64_t, int64_t, float*);
#endif
