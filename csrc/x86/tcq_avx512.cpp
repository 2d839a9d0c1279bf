// AVX-512 TCQ Viterbi step: 16 consecutive successor groups per register, the 2^s predecessors of
// each walked in the inner loop (over the blocked table copy, so reads are sequential) with the
// running min kept in registers; up to 8 sequences share each
// load of the state-value table (768 KB, meant to stay in L2), which also gives the min-chains
// independent work to hide their latency.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include "common/tcq.h"

#define TLB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

namespace torch_lowbit {
namespace {

// kNarrow (s == 3): the 16 states p0..p0+15 read two predecessor groups (p >> 3), not one.
template <int B, bool kNarrow>
TLB_AVX512 void step(const TcqCode& code, const float* const* prev, const float* ax, const float* ay,
                     float* const* next) {
  const int s = code.shift;
  const int64_t groups = int64_t{1} << (kTcqStateBits - s), fan = int64_t{1} << s;
  const __m512i lane_group = _mm512_srli_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 3);
  __m512 vax[B], vay[B];
  for (int i = 0; i < B; ++i) {
    vax[i] = _mm512_set1_ps(ax[i]);
    vay[i] = _mm512_set1_ps(ay[i]);
  }
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    __m512 best[B];
    for (int i = 0; i < B; ++i) best[i] = _mm512_set1_ps(__builtin_inff());
    const int64_t block = g0 * fan;
    for (int64_t k = 0; k < fan; ++k) {
      const int64_t p0 = k * groups + g0;
      const __m512 cx = _mm512_load_ps(code.cx_blocked + block + 16 * k);
      const __m512 cy = _mm512_load_ps(code.cy_blocked + block + 16 * k);
      const __m512 c2 = _mm512_load_ps(code.c2_blocked + block + 16 * k);
      for (int i = 0; i < B; ++i) {
        const __m512 from = kNarrow ? _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(prev[i] + (p0 >> s)))
                                    : _mm512_set1_ps(prev[i][p0 >> s]);
        const __m512 cost = _mm512_fmadd_ps(vay[i], cy, _mm512_fmadd_ps(vax[i], cx, _mm512_add_ps(from, c2)));
        best[i] = _mm512_min_ps(best[i], cost);  // = tcq_state_cost per lane
      }
    }
    for (int i = 0; i < B; ++i) _mm512_storeu_ps(next[i] + g0, best[i]);
  }
}

template <bool kNarrow>
TLB_AVX512 void step_batch(const TcqCode& code, int batch, const float* const* prev, const float* ax,
                           const float* ay, float* const* next) {
  static_assert(kTcqMaxBatch == 8, "one instantiation per batch size");
  switch (batch) {
    case 1: return step<1, kNarrow>(code, prev, ax, ay, next);
    case 2: return step<2, kNarrow>(code, prev, ax, ay, next);
    case 3: return step<3, kNarrow>(code, prev, ax, ay, next);
    case 4: return step<4, kNarrow>(code, prev, ax, ay, next);
    case 5: return step<5, kNarrow>(code, prev, ax, ay, next);
    case 6: return step<6, kNarrow>(code, prev, ax, ay, next);
    case 7: return step<7, kNarrow>(code, prev, ax, ay, next);
    default: return step<8, kNarrow>(code, prev, ax, ay, next);
  }
}

}  // namespace

TLB_AVX512 void tcq_step_avx512(const TcqCode& code, int batch, const float* const* prev, const float* ax,
                                const float* ay, float* const* next) {
  if (code.shift == 3) return step_batch<true>(code, batch, prev, ax, ay, next);
  step_batch<false>(code, batch, prev, ax, ay, next);  // s >= 4: 16 aligned states share one group
}

}  // namespace torch_lowbit
#endif  // TORCH_LOWBIT_X86
