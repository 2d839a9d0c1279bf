// Kernels of torch_lowbit::hadamard_transform: y = x @ (H_k ⊗ H_len) on fp32 row buffers.
//
// A row of n = k * len values is k contiguous blocks of len = 2^m. The Sylvester part is a fast
// Walsh-Hadamard transform of each block (log2(len) butterfly stages, in place); the base part
// mixes whole blocks with a k x k matrix. The two factors commute, so they run in either order.
#pragma once
#include <cstdint>

namespace torch_lowbit {

// In place, unnormalized: each of `blocks` runs of `len` floats (len a power of two) becomes
// run @ H_len.
using FwhtFn = void (*)(float* data, int64_t blocks, int64_t len);
// out[c * len + j] = sum_a mix[c * k + a] * in[a * len + j] for c < k; k is 1 or a multiple of 4.
using BlockMixFn = void (*)(const float* mix, int64_t k, const float* in, float* out, int64_t len);

void fwht_scalar(float* data, int64_t blocks, int64_t len);
void block_mix_scalar(const float* mix, int64_t k, const float* in, float* out, int64_t len);
#if defined(TORCH_LOWBIT_X86)
void fwht_avx2(float* data, int64_t blocks, int64_t len);
void block_mix_avx2(const float* mix, int64_t k, const float* in, float* out, int64_t len);
void fwht_avx512(float* data, int64_t blocks, int64_t len);
void block_mix_avx512(const float* mix, int64_t k, const float* in, float* out, int64_t len);
#endif
#if defined(__aarch64__)
void fwht_neon(float* data, int64_t blocks, int64_t len);
void block_mix_neon(const float* mix, int64_t k, const float* in, float* out, int64_t len);
#endif

}  // namespace torch_lowbit
