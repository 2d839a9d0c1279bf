// ARM NEON kernels for the int8-tile layouts lut{4,8}_i8_n16 (common/lut_i8.h has the layout and
// the math). The tile layout already fits ARM's dot products: a 16-byte load holds 4 codes of each
// of 4 rows, and `sdot v.4s, w.16b, x.4b[lane]` adds 4 rows' dot products with one activation quad.
// Codes become signed table values with one `tbl` (4-bit: the 16-entry table in a register) or, for
// 8-bit codes (q8_0: byte = q + 128), one eor with 0x80, so no unsigned offset term is needed (the
// integer sum equals the scalar path's sum(u * x) - offset * sum(x) exactly). Group codebooks (gcb2/3)
// look their values up in the codebooks held in registers (tbl over 4 registers; gcb3 adds tbx); the
// K-quants (kquant_i8_n16) weight each sub-block's dot product by its integer sub-scale in int32. This
// file: plain NEON (every aarch64 CPU), vmull_s8 + pairwise adds; lut_i8_dotprod.cpp: sdot.
#if defined(__aarch64__)
#include "arm/lut_i8_neon_kernel.h"

namespace torch_lowbit {
namespace {

// |products| <= 128 * 127, so a pair of them fits int16; pairs accumulate into int32.
struct NeonDot {
  template <int LANE>
  static int32x4_t dot(int32x4_t acc, int8x16_t vals, int8x16_t x) {
    const int8x16_t xb = vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(x), LANE));
    const int16x8_t p0 = vmull_s8(vget_low_s8(vals), vget_low_s8(xb));
    const int16x8_t p1 = vmull_high_s8(vals, xb);
    return vpadalq_s16(acc, vpaddq_s16(p0, p1));
  }
};

}  // namespace

void lut_i8_neon(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  lut_i8_neon_tiles<NeonDot>(w, a, t0, t1, out, ldo);
}

}  // namespace torch_lowbit
#endif  // __aarch64__
