// Kernels for the "lut4" family: 4-bit codes whose value is lut[code] * scale + min, per group.
// q4_0, int4_g* and (later) iq4_nl are all this family; the format supplies the 16-entry lut, so a
// kernel never re-derives a format's math.
//
// Row-major layout "lut4_rowmajor" (torch_lowbit/layouts/lut4.py packs it):
//   qweight [N, K/2] uint8: each run of 32 codes k0..k0+31 of a row occupies 16 bytes; byte j holds
//   code k0+j in its low nibble and code k0+16+j in its high nibble (ggml's Q4_0 block order, so
//   a SIMD register of 16 bytes yields 16 consecutive codes from the low and 16 from the high nibbles);
//   scales [N, K/group] fp16; mins [N, K/group] fp16 or absent; lut [16] fp32.
#pragma once
#include <c10/util/Half.h>

#include <cstdint>

namespace torch_lowbit {

struct Lut4Weights {
  const uint8_t* qweight;   // [N, K/2]
  const c10::Half* scales;  // [N, K/group]
  const c10::Half* mins;    // [N, K/group] or nullptr
  const float* lut;         // [16]
  int64_t N, K, group;
};

// out[m * ldo + n] = sum_k x[m * K + k] * W[n, k] for rows n in [n0, n1), all m < M (fused decode).
using Lut4GemvFn = void (*)(const Lut4Weights& w, const float* x, int64_t M, int64_t n0, int64_t n1,
                            float* out, int64_t ldo);
// dst[(n - n0) * K + k] = W[n, k] for n in [n0, n1).
using Lut4DequantFn = void (*)(const Lut4Weights& w, int64_t n0, int64_t n1, float* dst);

void lut4_gemv_scalar(const Lut4Weights&, const float*, int64_t, int64_t, int64_t, float*, int64_t);
void lut4_dequant_scalar(const Lut4Weights&, int64_t, int64_t, float*);
#if defined(TORCH_LOWBIT_X86)
void lut4_gemv_avx2(const Lut4Weights&, const float*, int64_t, int64_t, int64_t, float*, int64_t);
void lut4_dequant_avx2(const Lut4Weights&, int64_t, int64_t, float*);
void lut4_gemv_avx512(const Lut4Weights&, const float*, int64_t, int64_t, int64_t, float*, int64_t);
void lut4_dequant_avx512(const Lut4Weights&, int64_t, int64_t, float*);
#endif

// The portable decode of one 32-code run (16 bytes) into codes[32]; the reference every SIMD
// path's byte shuffling must agree with.
inline void lut4_unpack32(const uint8_t* bytes, uint8_t* codes) {
  for (int j = 0; j < 16; ++j) {
    codes[j] = bytes[j] & 0x0F;
    codes[j + 16] = bytes[j] >> 4;
  }
}

}  // namespace torch_lowbit
