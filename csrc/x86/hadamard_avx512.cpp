// AVX-512 Hadamard kernels (16 floats per vector; the passes are common/hadamard_simd.h).
//
// Butterfly stages with stride h < 16 stay inside one register: lane l pairs with lane l ^ h, and
// r = x * sign + partner gives lo + hi in the lower lane (sign +1) and lo - hi in the upper one
// (sign -1), one permute and one FMA per stage. Wider strides run two stages per pass (radix 4).
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#define TLB_KERNEL __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

namespace torch_lowbit {
namespace {

struct Avx512 {
  using T = __m512;
  static constexpr int64_t kLanes = 16, kStep = 16;
  static constexpr int kMixVectors = 4;
  TLB_KERNEL static T load(const float* p) { return _mm512_loadu_ps(p); }
  TLB_KERNEL static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  TLB_KERNEL static T add(T a, T b) { return _mm512_add_ps(a, b); }
  TLB_KERNEL static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  TLB_KERNEL static T zero() { return _mm512_setzero_ps(); }
  TLB_KERNEL static T fma(T acc, T v, float m) { return _mm512_fmadd_ps(_mm512_set1_ps(m), v, acc); }
  // All four in-register stages (h = 1, 2, 4, 8) of one 16-float vector.
  TLB_KERNEL static void stages_in_registers(float* x) {
    const __m512i pair1 = _mm512_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    const __m512i pair2 = _mm512_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const __m512i pair4 = _mm512_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    const __m512i pair8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 sign1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
    const __m512 sign2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
    const __m512 sign4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
    const __m512 sign8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m512 v = _mm512_loadu_ps(x);
    v = _mm512_fmadd_ps(v, sign1, _mm512_permutexvar_ps(pair1, v));
    v = _mm512_fmadd_ps(v, sign2, _mm512_permutexvar_ps(pair2, v));
    v = _mm512_fmadd_ps(v, sign4, _mm512_permutexvar_ps(pair4, v));
    _mm512_storeu_ps(x, _mm512_fmadd_ps(v, sign8, _mm512_permutexvar_ps(pair8, v)));
  }
};

}  // namespace
}  // namespace torch_lowbit

#include "common/hadamard_simd.h"

namespace torch_lowbit {

TLB_KERNEL void fwht_avx512(float* data, int64_t blocks, int64_t len) { fwht_rows<Avx512>(data, blocks, len); }

TLB_KERNEL void block_mix_avx512(const float* mix, int64_t k, const float* in, float* out, int64_t len) {
  block_mix_rows<Avx512>(mix, k, in, out, len);
}

}  // namespace torch_lowbit
#endif  // TORCH_LOWBIT_X86
