// AVX2 lut x int8 kernel (vpmaddubsw; the tile kernel itself is x86/lut_i8_avx2_kernel.h). Without
// vpdpbusd the products go through vpmaddubsw's saturating int16 pairs, so the table's byte range
// picks how they are summed (Small / Unsigned / Signed, see the kernel header). K-quants' integer
// sub-scales: x86/lut_i8_avx2_subscaled.h.
#if defined(TORCH_LOWBIT_X86)
#define TLB_KERNEL __attribute__((target("avx2,fma,f16c")))
#include "x86/lut_i8_avx2_kernel.h"
#include "x86/lut_i8_avx2_subscaled.h"

namespace torch_lowbit {

TLB_KERNEL void lut_i8_avx2(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  if (w.sub_scales) {  // K-quants: the widths of q2_k .. q6_k
    const bool ran = with_sub_scaled(w, [&](auto b, auto sub, auto mins) TLB_KERNEL {
      sub_scaled_range<decltype(b)::value, decltype(sub)::value, decltype(mins)::value>(w, a, t0, t1, out, ldo);
    });
    if (!ran) lut_i8_scalar(w, a, t0, t1, out, ldo);
    return;
  }
  int umax = 0;  // unused table entries are 0
  for (int i = 0; i < kI8MaxTable; ++i) umax = std::max<int>(umax, w.utable[i]);
  with_code_bits(w.bits, [&](auto b) TLB_KERNEL {
    constexpr int B = decltype(b)::value;
    // |x| <= 127: 8 pairs of u <= 16 fit int16, one pair of u <= 129 does
    if (umax <= 16 && B != 8) run_range<Dot::Small, B>(w, a, t0, t1, out, ldo);
    else if (umax <= 129) run_range<Dot::Unsigned, B>(w, a, t0, t1, out, ldo);
    else run_range<Dot::Signed, B>(w, a, t0, t1, out, ldo);
  });
}

}  // namespace torch_lowbit
#endif
