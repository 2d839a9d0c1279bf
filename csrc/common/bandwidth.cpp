// Probes for the benchmark's roofline model: DRAM read bandwidth (all threads stream a large buffer
// once) and the core clock (a chain of dependent integer adds, one per cycle).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>

#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>
#endif

#include "common/dispatch.h"

namespace torch_lowbit {
namespace {

#if defined(TORCH_LOWBIT_X86)
__attribute__((target("avx512f"))) int64_t xor_avx512(const int64_t* p, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 8));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 16));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 24));
  }
  int64_t r = _mm512_reduce_or_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
  for (; i < n; ++i) r ^= p[i];
  return r;
}
#endif

int64_t xor_scalar(const int64_t* p, int64_t n) {
  int64_t r = 0;
  for (int64_t i = 0; i < n; ++i) r ^= p[i];
  return r;
}

}  // namespace

// XOR of all 64-bit words of `buf` (read by all threads); returned so the reads cannot be elided.
int64_t read_probe(const at::Tensor& buf) {
  TORCH_CHECK(buf.is_contiguous() && buf.device().is_cpu() && buf.nbytes() % 8 == 0,
              "read_probe: a contiguous CPU buffer of whole 8-byte words");
  const int64_t* p = static_cast<const int64_t*>(buf.data_ptr());
  const int64_t n = buf.nbytes() / 8;
  std::atomic<int64_t> acc{0};
#if defined(TORCH_LOWBIT_X86)
  const bool wide = kernel_isa(active_cpu_path()) == CpuPath::Avx512;
#endif
  at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
#if defined(TORCH_LOWBIT_X86)
    acc ^= wide ? xor_avx512(p + b, e - b) : xor_scalar(p + b, e - b);
#else
    acc ^= xor_scalar(p + b, e - b);
#endif
  });
  return acc.load();
}

// Runs `steps` dependent steps of one clock cycle each; timing it gives the clock the kernels ran at
// (turbo included). x86: integer multiplies (3-cycle latency on every Intel and AMD core since
// Nehalem / Zen) counted as 3 steps each; add-immediate chains are no good, Golden Cove-class cores
// fold them at rename. Elsewhere: dependent adds.
int64_t clock_probe(int64_t steps) {
  int64_t x = 1;
#if defined(__x86_64__)
  for (int64_t i = 0; i < steps; i += 24)
    asm volatile("imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t"
                 "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0" : "+r"(x));
#elif defined(__aarch64__)
  for (int64_t i = 0; i < steps; i += 8)
    asm volatile("add %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1\n\t"
                 "add %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1\n\tadd %0, %0, #1" : "+r"(x));
#else
  for (int64_t i = 0; i < steps; ++i) asm volatile("" : "+r"(x)), x = x * 3 + 1;  // rough: a few cycles a step
#endif
  return x;
}

}  // namespace torch_lowbit
