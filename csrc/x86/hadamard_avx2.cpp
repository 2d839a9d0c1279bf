// AVX2 Hadamard kernels (8 floats per vector); the scheme of hadamard_avx512.cpp (the passes are
// common/hadamard_simd.h): stages with stride h < 8 inside one register (permute + FMA with a +-1
// lane pattern), wider strides two stages per pass.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#define TLB_KERNEL __attribute__((target("avx2,fma")))

namespace torch_lowbit {
namespace {

struct Avx2 {
  using T = __m256;
  static constexpr int64_t kLanes = 8, kStep = 8;
  static constexpr int kMixVectors = 2;  // 8 accumulators + 2 sources of the 16 ymm
  TLB_KERNEL static T load(const float* p) { return _mm256_loadu_ps(p); }
  TLB_KERNEL static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  TLB_KERNEL static T add(T a, T b) { return _mm256_add_ps(a, b); }
  TLB_KERNEL static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  TLB_KERNEL static T zero() { return _mm256_setzero_ps(); }
  TLB_KERNEL static T fma(T acc, T v, float m) { return _mm256_fmadd_ps(_mm256_set1_ps(m), v, acc); }
  // The three in-register stages (h = 1, 2, 4) of one 8-float vector.
  TLB_KERNEL static void stages_in_registers(float* x) {
    const __m256i pair1 = _mm256_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6);
    const __m256i pair2 = _mm256_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5);
    const __m256i pair4 = _mm256_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3);
    const __m256 sign1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 sign2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 sign4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    __m256 v = _mm256_loadu_ps(x);
    v = _mm256_fmadd_ps(v, sign1, _mm256_permutevar8x32_ps(v, pair1));
    v = _mm256_fmadd_ps(v, sign2, _mm256_permutevar8x32_ps(v, pair2));
    _mm256_storeu_ps(x, _mm256_fmadd_ps(v, sign4, _mm256_permutevar8x32_ps(v, pair4)));
  }
};

}  // namespace
}  // namespace torch_lowbit

#include "common/hadamard_simd.h"

namespace torch_lowbit {

TLB_KERNEL void fwht_avx2(float* data, int64_t blocks, int64_t len) { fwht_rows<Avx2>(data, blocks, len); }

TLB_KERNEL void block_mix_avx2(const float* mix, int64_t k, const float* in, float* out, int64_t len) {
  block_mix_rows<Avx2>(mix, k, in, out, len);
}

}  // namespace torch_lowbit
#endif  // TORCH_LOWBIT_X86
