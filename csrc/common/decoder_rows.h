// One query row of attention over L keys: softmax(q · k_j · scale + mask_j) weighted sum of the v_j.
// Shared by the gqa_attention op (csrc/attention.cpp) and the native decoder (csrc/native_decoder.cpp);
// one build per ISA path (common/decoder_rows_impl.h is the code).
#pragma once
#include <cstdint>

namespace torch_lowbit {

// k and v: L rows of D floats, `stride` floats apart (a cache's rows). mask: nullptr or additive, entry
// j at mask[j * mask_stride]. p: scratch of L floats. A row whose every score is -inf gives NaN (as
// softmax does).
using AttendRowFn = void (*)(const float* q, const float* k, const float* v, int64_t stride, int64_t L, int64_t D,
                             float scale, const float* mask, int64_t mask_stride, float* p, float* out);

void attend_row_scalar(const float*, const float*, const float*, int64_t, int64_t, int64_t, float, const float*,
                       int64_t, float*, float*);
#if defined(TORCH_LOWBIT_X86)
void attend_row_avx2(const float*, const float*, const float*, int64_t, int64_t, int64_t, float, const float*,
                     int64_t, float*, float*);
void attend_row_avx512(const float*, const float*, const float*, int64_t, int64_t, int64_t, float, const float*,
                       int64_t, float*, float*);
#endif

// G query rows (G x D, contiguous) of the heads sharing one KV head, unmasked: each key and value row
// read once for all of them. p: scratch of G x L floats; out: G x D.
using AttendGroupFn = void (*)(const float* q, int64_t G, const float* k, const float* v, int64_t stride, int64_t L,
                               int64_t D, float scale, float* p, float* out);

#define TLB_ATTEND_GROUP_ARGS const float*, int64_t, const float*, const float*, int64_t, int64_t, int64_t, float, float*, float*
void attend_group_scalar(TLB_ATTEND_GROUP_ARGS);
#if defined(TORCH_LOWBIT_X86)
void attend_group_avx2(TLB_ATTEND_GROUP_ARGS);
void attend_group_avx512(TLB_ATTEND_GROUP_ARGS);
#endif
#undef TLB_ATTEND_GROUP_ARGS

// out = silu(g) * u over n features.
using SiluMulFn = void (*)(const float* g, const float* u, int64_t n, float* out);
void silu_mul_scalar(const float*, const float*, int64_t, float*);
#if defined(TORCH_LOWBIT_X86)
void silu_mul_avx2(const float*, const float*, int64_t, float*);
void silu_mul_avx512(const float*, const float*, int64_t, float*);
#endif

// The active ISA path's builds.
AttendRowFn attend_row_kernel();
AttendGroupFn attend_group_kernel();
SiluMulFn silu_mul_kernel();

}  // namespace torch_lowbit
