// Helpers shared by the NEON palette kernels (palette_neon.cpp: TCQ; palette_codebook_neon.cpp: nuq / vq).
#pragma once
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cstdint>

namespace torch_lowbit {
namespace palette_neon {

// Tokens per register-blocked run of the fused GEMVs (for_token_blocks).
constexpr int kMaxTokenBlock = 4;

// The (x, y) entries of an interleaved 2-D table at the 4 lanes' indices, in lane order: lanes 0, 1 in
// `first` (x0 y0 x1 y1), lanes 2, 3 in `second`. NEON has no gather: one 64-bit load per lane.
inline void load_pairs(const float* pairs, uint32x4_t index, float32x4_t& first, float32x4_t& second) {
  first = vcombine_f32(vld1_f32(pairs + 2 * vgetq_lane_u32(index, 0)), vld1_f32(pairs + 2 * vgetq_lane_u32(index, 1)));
  second = vcombine_f32(vld1_f32(pairs + 2 * vgetq_lane_u32(index, 2)), vld1_f32(pairs + 2 * vgetq_lane_u32(index, 3)));
}

}  // namespace palette_neon
}  // namespace torch_lowbit
#endif  // __aarch64__
