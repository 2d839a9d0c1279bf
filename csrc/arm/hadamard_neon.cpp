// NEON Hadamard kernels (4 floats per vector), the scheme of x86/hadamard_avx2.cpp (the passes are
// common/hadamard_simd.h): the two stages with stride h < 4 inside registers (h = 1: even / odd lanes
// of two vectors by uzp, sums and differences, zip back; h = 2: low and high halves), wider strides
// two stages per pass. Every output is the scalar path's sums in the scalar path's order (the +-1 mix
// products are exact), so the result equals fwht_scalar / block_mix_scalar bit for bit.
#if defined(__aarch64__)
#include <arm_neon.h>

#define TLB_KERNEL

namespace torch_lowbit {
namespace {

struct Neon {
  using T = float32x4_t;
  static constexpr int64_t kLanes = 4, kStep = 8;  // the in-register stages run on 8 floats (two vectors)
  static constexpr int kMixVectors = 4;
  static T load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, T v) { vst1q_f32(p, v); }
  static T add(T a, T b) { return vaddq_f32(a, b); }
  static T sub(T a, T b) { return vsubq_f32(a, b); }
  static T zero() { return vdupq_n_f32(0.f); }
  static T fma(T acc, T v, float m) { return vfmaq_n_f32(acc, v, m); }
  // Stages h = 1 and 2 of 8 floats at x.
  static void stages_in_registers(float* x) {
    const float32x4_t v0 = vld1q_f32(x), v1 = vld1q_f32(x + 4);
    const float32x4_t even = vuzp1q_f32(v0, v1), odd = vuzp2q_f32(v0, v1);  // x0 x2 x4 x6 | x1 x3 x5 x7
    const float32x4_t s = vaddq_f32(even, odd), d = vsubq_f32(even, odd);
    const float32x4_t w0 = vzip1q_f32(s, d), w1 = vzip2q_f32(s, d);  // stage 1 done, in order
    const float32x2_t lo0 = vget_low_f32(w0), hi0 = vget_high_f32(w0);
    const float32x2_t lo1 = vget_low_f32(w1), hi1 = vget_high_f32(w1);
    vst1q_f32(x, vcombine_f32(vadd_f32(lo0, hi0), vsub_f32(lo0, hi0)));
    vst1q_f32(x + 4, vcombine_f32(vadd_f32(lo1, hi1), vsub_f32(lo1, hi1)));
  }
};

}  // namespace
}  // namespace torch_lowbit

#include "common/hadamard_simd.h"

namespace torch_lowbit {

void fwht_neon(float* data, int64_t blocks, int64_t len) { fwht_rows<Neon>(data, blocks, len); }

void block_mix_neon(const float* mix, int64_t k, const float* in, float* out, int64_t len) {
  block_mix_rows<Neon>(mix, k, in, out, len);
}

}  // namespace torch_lowbit
#endif  // __aarch64__
