// AVX2 TCQ Viterbi step: the AVX-512 step's walk (tcq_avx512.cpp) with each 16-group block held in
// two 8-lane halves. Same blocked table, same operation order (add, FMA x, FMA y, min), so it is bit
// for bit the scalar step. For s == 3 the 16 states of a block read two predecessor groups, one per
// half, so both halves still broadcast a single prev value.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include "common/tcq.h"

#define TLB_AVX2 __attribute__((target("avx2,fma")))

namespace torch_lowbit {
namespace {

template <int B, bool kNarrow>
TLB_AVX2 void step(const TcqCode& code, const float* const* prev, const float* ax, const float* ay,
                   float* const* next) {
  const int s = code.shift;
  const int64_t groups = int64_t{1} << (kTcqStateBits - s), fan = int64_t{1} << s;
  __m256 vax[B], vay[B];
  for (int i = 0; i < B; ++i) {
    vax[i] = _mm256_set1_ps(ax[i]);
    vay[i] = _mm256_set1_ps(ay[i]);
  }
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    __m256 lo[B], hi[B];
    for (int i = 0; i < B; ++i) lo[i] = hi[i] = _mm256_set1_ps(__builtin_inff());
    const float* cxb = code.cx_blocked + g0 * fan;
    const float* cyb = code.cy_blocked + g0 * fan;
    const float* c2b = code.c2_blocked + g0 * fan;
    for (int64_t k = 0; k < fan; ++k) {
      const int64_t group = (k * groups + g0) >> s;  // predecessor group of the block's first state
      const __m256 cx_lo = _mm256_load_ps(cxb + 16 * k), cx_hi = _mm256_load_ps(cxb + 16 * k + 8);
      const __m256 cy_lo = _mm256_load_ps(cyb + 16 * k), cy_hi = _mm256_load_ps(cyb + 16 * k + 8);
      const __m256 c2_lo = _mm256_load_ps(c2b + 16 * k), c2_hi = _mm256_load_ps(c2b + 16 * k + 8);
      for (int i = 0; i < B; ++i) {
        const __m256 from_lo = _mm256_set1_ps(prev[i][group]);
        const __m256 from_hi = kNarrow ? _mm256_set1_ps(prev[i][group + 1]) : from_lo;
        const __m256 cost_lo =
            _mm256_fmadd_ps(vay[i], cy_lo, _mm256_fmadd_ps(vax[i], cx_lo, _mm256_add_ps(from_lo, c2_lo)));
        const __m256 cost_hi =
            _mm256_fmadd_ps(vay[i], cy_hi, _mm256_fmadd_ps(vax[i], cx_hi, _mm256_add_ps(from_hi, c2_hi)));
        lo[i] = _mm256_min_ps(lo[i], cost_lo);  // = tcq_state_cost per lane
        hi[i] = _mm256_min_ps(hi[i], cost_hi);
      }
    }
    for (int i = 0; i < B; ++i) {
      _mm256_storeu_ps(next[i] + g0, lo[i]);
      _mm256_storeu_ps(next[i] + g0 + 8, hi[i]);
    }
  }
}

template <bool kNarrow>
TLB_AVX2 void step_batch(const TcqCode& code, int batch, const float* const* prev, const float* ax,
                         const float* ay, float* const* next) {
  // Two accumulators per sequence: past 4 sequences the 16 ymm registers would spill.
  static_assert(kTcqMaxBatch == 8, "batches above 4 run in two passes");
  switch (batch) {
    case 1: return step<1, kNarrow>(code, prev, ax, ay, next);
    case 2: return step<2, kNarrow>(code, prev, ax, ay, next);
    case 3: return step<3, kNarrow>(code, prev, ax, ay, next);
    case 4: return step<4, kNarrow>(code, prev, ax, ay, next);
    default:
      step<4, kNarrow>(code, prev, ax, ay, next);
      return step_batch<kNarrow>(code, batch - 4, prev + 4, ax + 4, ay + 4, next + 4);
  }
}

}  // namespace

TLB_AVX2 void tcq_step_avx2(const TcqCode& code, int batch, const float* const* prev, const float* ax,
                            const float* ay, float* const* next) {
  if (code.shift == 3) return step_batch<true>(code, batch, prev, ax, ay, next);
  step_batch<false>(code, batch, prev, ax, ay, next);  // s >= 4: 16 aligned states share one group
}

}  // namespace torch_lowbit
#endif  // TORCH_LOWBIT_X86
