// The Hadamard passes of the SIMD paths (x86/hadamard_avx2.cpp, x86/hadamard_avx512.cpp,
// arm/hadamard_neon.cpp), written once over a vector type. The including file defines TLB_KERNEL
// (its target attribute; empty on NEON) and a struct with:
//   T; kLanes (floats per T); kStep (floats stages_in_registers transforms per call: the stages with
//   stride h < kLanes); kMixVectors (columns of a mix tile, in vectors: what the registers hold with
//   4 x that many accumulators); load, store, add, sub, zero; fma(acc, v, m) = acc + v * m (m a
//   scalar); stages_in_registers(float* x).
// Every path adds and subtracts in the scalar code's order and multiplies by the exact +-1 entries,
// so its results equal fwht_scalar / block_mix_scalar bit for bit.
#pragma once
#include <cstdint>

#include "common/hadamard.h"

namespace torch_lowbit {
namespace {

constexpr int64_t kHadamardL1Chunk = 2048;  // floats: 8 KiB

// Stages h_begin, 2 h_begin, ... < h_end (h_begin >= one vector) over x[0, len): two per pass (radix 4,
// so a long row is streamed half as often), then a radix-2 pass if one is left.
template <class V>
TLB_KERNEL void butterfly_passes(float* x, int64_t len, int64_t h_begin, int64_t h_end) {
  int64_t h = h_begin;
  for (; 4 * h <= h_end; h *= 4) {
    for (int64_t i = 0; i < len; i += 4 * h) {
      for (int64_t j = i; j < i + h; j += V::kLanes) {
        const auto v0 = V::load(x + j), v1 = V::load(x + j + h);
        const auto v2 = V::load(x + j + 2 * h), v3 = V::load(x + j + 3 * h);
        const auto s01 = V::add(v0, v1), d01 = V::sub(v0, v1);
        const auto s23 = V::add(v2, v3), d23 = V::sub(v2, v3);
        V::store(x + j, V::add(s01, s23));
        V::store(x + j + h, V::add(d01, d23));
        V::store(x + j + 2 * h, V::sub(s01, s23));
        V::store(x + j + 3 * h, V::sub(d01, d23));
      }
    }
  }
  if (2 * h == h_end) {
    for (int64_t i = 0; i < len; i += 2 * h) {
      for (int64_t j = i; j < i + h; j += V::kLanes) {
        const auto lo = V::load(x + j), hi = V::load(x + j + h);
        V::store(x + j, V::add(lo, hi));
        V::store(x + j + h, V::sub(lo, hi));
      }
    }
  }
}

template <class V>
TLB_KERNEL void fwht_block(float* x, int64_t len) {
  // Strides below kHadamardL1Chunk run chunk by chunk while the chunk sits in L1; only the wider ones
  // stream the whole block (a 2^14 row is 64 KiB, past L1).
  const int64_t chunk = len < kHadamardL1Chunk ? len : kHadamardL1Chunk;
  for (int64_t c0 = 0; c0 < len; c0 += chunk) {
    for (int64_t j = c0; j < c0 + chunk; j += V::kStep) V::stages_in_registers(x + j);
    butterfly_passes<V>(x + c0, chunk, V::kLanes, chunk);
  }
  butterfly_passes<V>(x, len, chunk, len);
}

// Output blocks c..c+3, columns j..j+kLanes*N: four rows of the mix share every input load.
template <class V, int N>
TLB_KERNEL inline void mix_tile(const float* mix, int64_t k, const float* in, float* out, int64_t len, int64_t c,
                                int64_t j) {
  typename V::T acc[4][N];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < N; ++v) acc[r][v] = V::zero();
  for (int64_t a = 0; a < k; ++a) {
    typename V::T src[N];
    for (int v = 0; v < N; ++v) src[v] = V::load(in + a * len + j + v * V::kLanes);
    for (int r = 0; r < 4; ++r) {
      const float m = mix[(c + r) * k + a];
      for (int v = 0; v < N; ++v) acc[r][v] = V::fma(acc[r][v], src[v], m);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < N; ++v) V::store(out + (c + r) * len + j + v * V::kLanes, acc[r][v]);
}

// FwhtFn over the vector type (rows shorter than a register step: the scalar code).
template <class V>
TLB_KERNEL void fwht_rows(float* data, int64_t blocks, int64_t len) {
  if (len < V::kStep) return fwht_scalar(data, blocks, len);
  for (int64_t b = 0; b < blocks; ++b) fwht_block<V>(data + b * len, len);
}

// BlockMixFn over the vector type (k not a multiple of 4, or rows under a vector: the scalar code).
template <class V>
TLB_KERNEL void block_mix_rows(const float* mix, int64_t k, const float* in, float* out, int64_t len) {
  if (len < V::kLanes || k % 4 != 0) return block_mix_scalar(mix, k, in, out, len);
  for (int64_t c = 0; c < k; c += 4) {
    int64_t j = 0;
    constexpr int64_t wide = V::kMixVectors * V::kLanes;
    for (; j + wide <= len; j += wide) mix_tile<V, V::kMixVectors>(mix, k, in, out, len, c, j);
    for (; j < len; j += V::kLanes) mix_tile<V, 1>(mix, k, in, out, len, c, j);
  }
}

}  // namespace
}  // namespace torch_lowbit
