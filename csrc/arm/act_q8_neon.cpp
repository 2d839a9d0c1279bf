// NEON twins of the activation quantizers (common/act_q8.h): the same operations as the scalar loops,
// so the same bytes. Q8 blocks: amax / 127, x * (1 / d) rounded half-even (fcvtns), int8. Per-token
// codes: x / d rounded half-even, clamped to [qmin, qmax].
#if defined(__aarch64__)
#include <arm_neon.h>

#include "common/act_q8.h"

namespace torch_lowbit {

void quantize_act_blocks_neon(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, int32_t* sum) {
  for (int64_t b = b0; b < b1; ++b) {
    float32x4_t v[8], m = vdupq_n_f32(0.f);
    for (int i = 0; i < 8; ++i) m = vmaxq_f32(m, vabsq_f32(v[i] = vld1q_f32(x + b * 32 + 4 * i)));
    const float db = vmaxvq_f32(m) / 127.f;
    const float inv = db != 0.f ? 1.f / db : 0.f;
    int32x4_t s = vdupq_n_s32(0);
    int16x8_t h[4];
    for (int i = 0; i < 4; ++i) {
      const int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(v[2 * i], inv)), c = vcvtnq_s32_f32(vmulq_n_f32(v[2 * i + 1], inv));
      s = vaddq_s32(s, vaddq_s32(a, c));
      h[i] = vcombine_s16(vmovn_s32(a), vmovn_s32(c));  // |code| <= 127
    }
    vst1q_s8(q + b * 32, vcombine_s8(vmovn_s16(h[0]), vmovn_s16(h[1])));
    vst1q_s8(q + b * 32 + 16, vcombine_s8(vmovn_s16(h[2]), vmovn_s16(h[3])));
    d[b] = db;
    sum[b] = vaddvq_s32(s);
  }
}

void quantize_token_neon(const float* x, int64_t K, float d, int qmin, int qmax, int8_t* q) {
  const float32x4_t dv = vdupq_n_f32(d);
  const int32x4_t lo = vdupq_n_s32(qmin), hi = vdupq_n_s32(qmax);
  for (int64_t k = 0; k < K; k += 8) {  // |x / d| <= qmax / clip: no int32 overflow before the clamp
    const int32x4_t a = vminq_s32(vmaxq_s32(vcvtnq_s32_f32(vdivq_f32(vld1q_f32(x + k), dv)), lo), hi);
    const int32x4_t c = vminq_s32(vmaxq_s32(vcvtnq_s32_f32(vdivq_f32(vld1q_f32(x + k + 4), dv)), lo), hi);
    vst1_s8(q + k, vmovn_s16(vcombine_s16(vmovn_s32(a), vmovn_s32(c))));
  }
}

}  // namespace torch_lowbit
#endif  // __aarch64__
