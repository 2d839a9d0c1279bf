// AVX2 Hadamard kernels (8 floats per vector); same scheme as hadamard_avx512.cpp: stages with
// stride h < 8 inside one register (permute + FMA with a +-1 lane pattern), wider strides two
// stages per pass.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include "common/hadamard.h"

#define TLB_AVX2 __attribute__((target("avx2,fma")))

namespace torch_lowbit {
namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kL1Chunk = 2048;  // floats: 8 KiB

// The three in-register stages (h = 1, 2, 4) of one 8-float vector.
TLB_AVX2 inline __m256 fwht8(__m256 v) {
  const __m256i pair1 = _mm256_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6);
  const __m256i pair2 = _mm256_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5);
  const __m256i pair4 = _mm256_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3);
  const __m256 sign1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
  const __m256 sign2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
  const __m256 sign4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
  v = _mm256_fmadd_ps(v, sign1, _mm256_permutevar8x32_ps(v, pair1));
  v = _mm256_fmadd_ps(v, sign2, _mm256_permutevar8x32_ps(v, pair2));
  return _mm256_fmadd_ps(v, sign4, _mm256_permutevar8x32_ps(v, pair4));
}

// Stages h_begin, 2 h_begin, ... < h_end (h_begin >= one vector) over x[0, len): two per pass,
// then a radix-2 pass if one is left.
TLB_AVX2 void butterfly_passes(float* x, int64_t len, int64_t h_begin, int64_t h_end) {
  int64_t h = h_begin;
  for (; 4 * h <= h_end; h *= 4) {
    for (int64_t i = 0; i < len; i += 4 * h) {
      for (int64_t j = i; j < i + h; j += kLanes) {
        const __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + h);
        const __m256 v2 = _mm256_loadu_ps(x + j + 2 * h), v3 = _mm256_loadu_ps(x + j + 3 * h);
        const __m256 s01 = _mm256_add_ps(v0, v1), d01 = _mm256_sub_ps(v0, v1);
        const __m256 s23 = _mm256_add_ps(v2, v3), d23 = _mm256_sub_ps(v2, v3);
        _mm256_storeu_ps(x + j, _mm256_add_ps(s01, s23));
        _mm256_storeu_ps(x + j + h, _mm256_add_ps(d01, d23));
        _mm256_storeu_ps(x + j + 2 * h, _mm256_sub_ps(s01, s23));
        _mm256_storeu_ps(x + j + 3 * h, _mm256_sub_ps(d01, d23));
      }
    }
  }
  if (2 * h == h_end) {
    for (int64_t i = 0; i < len; i += 2 * h) {
      for (int64_t j = i; j < i + h; j += kLanes) {
        const __m256 lo = _mm256_loadu_ps(x + j), hi = _mm256_loadu_ps(x + j + h);
        _mm256_storeu_ps(x + j, _mm256_add_ps(lo, hi));
        _mm256_storeu_ps(x + j + h, _mm256_sub_ps(lo, hi));
      }
    }
  }
}

TLB_AVX2 void fwht_block(float* x, int64_t len) {
  // Strides below kL1Chunk run chunk by chunk while the chunk sits in L1; only the wider ones
  // stream the whole block (a 2^14 row is 64 KiB, past L1).
  const int64_t chunk = len < kL1Chunk ? len : kL1Chunk;
  for (int64_t c0 = 0; c0 < len; c0 += chunk) {
    for (int64_t j = c0; j < c0 + chunk; j += kLanes) _mm256_storeu_ps(x + j, fwht8(_mm256_loadu_ps(x + j)));
    butterfly_passes(x + c0, chunk, kLanes, chunk);
  }
  butterfly_passes(x, len, chunk, len);
}

// Output blocks c..c+3, columns j..j+8*V: four rows of the mix share every input load
// (4 x V accumulators + V sources fit the 16 ymm registers for V <= 2).
template <int V>
TLB_AVX2 inline void mix_tile(const float* mix, int64_t k, const float* in, float* out, int64_t len,
                              int64_t c, int64_t j) {
  __m256 acc[4][V];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t a = 0; a < k; ++a) {
    __m256 src[V];
    for (int v = 0; v < V; ++v) src[v] = _mm256_loadu_ps(in + a * len + j + v * kLanes);
    for (int r = 0; r < 4; ++r) {
      const __m256 m = _mm256_broadcast_ss(mix + (c + r) * k + a);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(m, src[v], acc[r][v]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(out + (c + r) * len + j + v * kLanes, acc[r][v]);
}

}  // namespace

TLB_AVX2 void fwht_avx2(float* data, int64_t blocks, int64_t len) {
  if (len < kLanes) return fwht_scalar(data, blocks, len);
  for (int64_t b = 0; b < blocks; ++b) fwht_block(data + b * len, len);
}

TLB_AVX2 void block_mix_avx2(const float* mix, int64_t k, const float* in, float* out, int64_t len) {
  if (len < kLanes || k % 4 != 0) return block_mix_scalar(mix, k, in, out, len);
  for (int64_t c = 0; c < k; c += 4) {
    int64_t j = 0;
    for (; j + 2 * kLanes <= len; j += 2 * kLanes) mix_tile<2>(mix, k, in, out, len, c, j);
    for (; j < len; j += kLanes) mix_tile<1>(mix, k, in, out, len, c, j);
  }
}

}  // namespace torch_lowbit
#endif  // TORCH_LOWBIT_X86
