// AVX-512 Hadamard kernels (16 floats per vector).
//
// Butterfly stages with stride h < 16 stay inside one register: lane l pairs with lane l ^ h, and
// r = x * sign + partner gives lo + hi in the lower lane (sign +1) and lo - hi in the upper one
// (sign -1), one permute and one FMA per stage. Wider strides run two stages per pass (radix 4)
// so a long row is streamed half as often.
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include "common/hadamard.h"

#define TLB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

namespace torch_lowbit {
namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kL1Chunk = 2048;  // floats: 8 KiB

// All four in-register stages (h = 1, 2, 4, 8) of one 16-float vector.
TLB_AVX512 inline __m512 fwht16(__m512 v) {
  const __m512i pair1 = _mm512_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  const __m512i pair2 = _mm512_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const __m512i pair4 = _mm512_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  const __m512i pair8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512 sign1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
  const __m512 sign2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
  const __m512 sign4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
  const __m512 sign8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
  v = _mm512_fmadd_ps(v, sign1, _mm512_permutexvar_ps(pair1, v));
  v = _mm512_fmadd_ps(v, sign2, _mm512_permutexvar_ps(pair2, v));
  v = _mm512_fmadd_ps(v, sign4, _mm512_permutexvar_ps(pair4, v));
  return _mm512_fmadd_ps(v, sign8, _mm512_permutexvar_ps(pair8, v));
}

// Stages h_begin, 2 h_begin, ... < h_end (h_begin >= one vector) over x[0, len): two per pass,
// then a radix-2 pass if one is left.
TLB_AVX512 void butterfly_passes(float* x, int64_t len, int64_t h_begin, int64_t h_end) {
  int64_t h = h_begin;
  for (; 4 * h <= h_end; h *= 4) {
    for (int64_t i = 0; i < len; i += 4 * h) {
      for (int64_t j = i; j < i + h; j += kLanes) {
        const __m512 v0 = _mm512_loadu_ps(x + j), v1 = _mm512_loadu_ps(x + j + h);
        const __m512 v2 = _mm512_loadu_ps(x + j + 2 * h), v3 = _mm512_loadu_ps(x + j + 3 * h);
        const __m512 s01 = _mm512_add_ps(v0, v1), d01 = _mm512_sub_ps(v0, v1);
        const __m512 s23 = _mm512_add_ps(v2, v3), d23 = _mm512_sub_ps(v2, v3);
        _mm512_storeu_ps(x + j, _mm512_add_ps(s01, s23));
        _mm512_storeu_ps(x + j + h, _mm512_add_ps(d01, d23));
        _mm512_storeu_ps(x + j + 2 * h, _mm512_sub_ps(s01, s23));
        _mm512_storeu_ps(x + j + 3 * h, _mm512_sub_ps(d01, d23));
      }
    }
  }
  if (2 * h == h_end) {
    for (int64_t i = 0; i < len; i += 2 * h) {
      for (int64_t j = i; j < i + h; j += kLanes) {
        const __m512 lo = _mm512_loadu_ps(x + j), hi = _mm512_loadu_ps(x + j + h);
        _mm512_storeu_ps(x + j, _mm512_add_ps(lo, hi));
        _mm512_storeu_ps(x + j + h, _mm512_sub_ps(lo, hi));
      }
    }
  }
}

TLB_AVX512 void fwht_block(float* x, int64_t len) {
  // Strides below kL1Chunk run chunk by chunk while the chunk sits in L1; only the wider ones
  // stream the whole block (a 2^14 row is 64 KiB, past L1).
  const int64_t chunk = len < kL1Chunk ? len : kL1Chunk;
  for (int64_t c0 = 0; c0 < len; c0 += chunk) {
    for (int64_t j = c0; j < c0 + chunk; j += kLanes) _mm512_storeu_ps(x + j, fwht16(_mm512_loadu_ps(x + j)));
    butterfly_passes(x + c0, chunk, kLanes, chunk);
  }
  butterfly_passes(x, len, chunk, len);
}

// Output blocks c..c+3, columns j..j+16*V: four rows of the mix share every input load.
template <int V>
TLB_AVX512 inline void mix_tile(const float* mix, int64_t k, const float* in, float* out, int64_t len,
                                int64_t c, int64_t j) {
  __m512 acc[4][V];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t a = 0; a < k; ++a) {
    __m512 src[V];
    for (int v = 0; v < V; ++v) src[v] = _mm512_loadu_ps(in + a * len + j + v * kLanes);
    for (int r = 0; r < 4; ++r) {
      const __m512 m = _mm512_set1_ps(mix[(c + r) * k + a]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(m, src[v], acc[r][v]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + (c + r) * len + j + v * kLanes, acc[r][v]);
}

}  // namespace

TLB_AVX512 void fwht_avx512(float* data, int64_t blocks, int64_t len) {
  if (len < kLanes) return fwht_scalar(data, blocks, len);
  for (int64_t b = 0; b < blocks; ++b) fwht_block(data + b * len, len);
}

TLB_AVX512 void block_mix_avx512(const float* mix, int64_t k, const float* in, float* out, int64_t len) {
  if (len < kLanes || k % 4 != 0) return block_mix_scalar(mix, k, in, out, len);
  for (int64_t c = 0; c < k; c += 4) {
    int64_t j = 0;
    for (; j + 4 * kLanes <= len; j += 4 * kLanes) mix_tile<4>(mix, k, in, out, len, c, j);
    for (; j < len; j += kLanes) mix_tile<1>(mix, k, in, out, len, c, j);
  }
}

}  // namespace torch_lowbit
#endif  // TORCH_LOWBIT_X86
