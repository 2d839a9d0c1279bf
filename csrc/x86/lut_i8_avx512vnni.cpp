// AVX-512 VNNI lut x int8 kernel (identity and 16-entry tables, q8_0's bytes, K-quants' integer sub-scales);
// the tile kernels themselves are x86/lut_i8_avx512_kernel.h and x86/lut_i8_avx512_subscaled.h.
#if defined(TORCH_LOWBIT_X86)
#define TLB_KERNEL __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#include "x86/lut_i8_avx512_kernel.h"
#include "x86/lut_i8_avx512_subscaled.h"

namespace torch_lowbit {
namespace {

template <int B>
TLB_KERNEL void run_bits(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out, int64_t ldo) {
  if constexpr (B == 8) {  // q8_0: the table is code - 128 (checked by the op), the offset undoes it
    run_range<Lookup::Identity, 8>(w, a, t0, t1, out, ldo);
  } else {
    bool identity = !w.pairs;
    for (int i = 0; i < (1 << B); ++i) identity &= w.utable[i] == i;
    if (identity)
      run_range<Lookup::Identity, B>(w, a, t0, t1, out, ldo);
    else
      run_range<Lookup::Table16, B>(w, a, t0, t1, out, ldo);
  }
}

}  // namespace

TLB_KERNEL void lut_i8_avx512vnni(const LutI8Weights& w, const Q8Acts& a, int64_t t0, int64_t t1, float* out,
                                 int64_t ldo) {
  if (w.sub_scales) {  // K-quants: the widths of q2_k .. q6_k
    const bool ran = with_sub_scaled(w, [&](auto b, auto sub, auto mins) TLB_KERNEL {
      sub_scaled_range<decltype(b)::value, decltype(sub)::value, decltype(mins)::value>(w, a, t0, t1, out, ldo);
    });
    if (!ran) lut_i8_scalar(w, a, t0, t1, out, ldo);
    return;
  }
  with_code_bits(w.bits, [&](auto b) TLB_KERNEL { run_bits<decltype(b)::value>(w, a, t0, t1, out, ldo); });
}

}  // namespace torch_lowbit
#endif
