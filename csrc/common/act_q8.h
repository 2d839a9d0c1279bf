// Dynamic int8 activations, one fp32 scale per 32 consecutive features of a token (ggml's Q8_0
// math): d = max|x| / 127, q = round_half_even(x / d) computed as x * (1 / d). The pure-torch
// twin that tests compare with is torch_lowbit/formats/activations.py.
#pragma once
#include <cstdint>
#include <cstring>

namespace torch_lowbit {

struct Q8Acts {
  const int8_t* q;     // [M, K]
  const float* d;      // [M, K/32]
  const int32_t* sum;  // [M, K/32]: sum of q over the block (for offsets and mins)
  int64_t M, K;
  const float* group_dsum = nullptr;  // [M, K/group]: sum of d * float(sum) over a group's blocks
  // Per-token activations (one d per token, quantize_acts_per_token): the lut_i8 kernels sum a
  // group's integer products in int32 and convert once per group (common/lut_i8.h).
  bool per_token = false;
  const int32_t* group_qsum = nullptr;  // per_token: [M, K/group] sum of q over a group's blocks
};

#if defined(TORCH_LOWBIT_X86)
void quantize_act_blocks_avx512(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, int32_t* sum);
void quantize_act_blocks_avx2(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, int32_t* sum);
void quantize_token_avx2(const float* x, int64_t K, float d, int qmin, int qmax, int8_t* q);  // K % 8 == 0
#endif
#if defined(__aarch64__)
void quantize_act_blocks_neon(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, int32_t* sum);
void quantize_token_neon(const float* x, int64_t K, float d, int qmin, int qmax, int8_t* q);  // K % 8 == 0
#endif

// group_dsum of a.q/d/sum for groups of `group` features, in block order (plain fp32 sums).
void group_dsums(const Q8Acts& a, int64_t group, float* out);

// The 4 consecutive int8 activations at p as one 32-bit word (for broadcasting to every lane).
inline int32_t load_act4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Quantizes x [M, K] (K % 32 == 0) into the three buffers (threaded over tokens and blocks), with
// the active ISA path's block quantizer (all produce the same bytes).
void quantize_acts_q8(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* sum);

// Per-token symmetric activations of `bits` bits (QuaRot's A8 / A4; fake_quantize_per_token in
// torch_lowbit/nn/act_quant.py is the twin): d = max|x| * (clip / (2^(bits-1) - 1)) per token (1 if 0),
// q = clamp(round_half_even(x / d), -2^(bits-1) (-127 at 8 bits), 2^(bits-1) - 1); every block of the
// token gets d.
void quantize_acts_per_token(const float* x, int64_t M, int64_t K, int bits, double clip, int8_t* q, float* d,
                             int32_t* sum);

}  // namespace torch_lowbit
