// Dynamic int8 activations, one fp32 scale per 32 consecutive features of a token (ggml's Q8_0
// math): d = max|x| / 127, q = round_half_even(x / d) computed as x * (1 / d). The pure-torch
// twin that tests compare with is torch_lowbit/core/activations.py.
#pragma once
#include <algorithm>
#include <cmath>
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
  const int32_t* half_sum = nullptr;    // [M, K/16] sum of q over each 16 features (K-quants' sub-blocks of 16)
};

#if defined(TORCH_LOWBIT_X86)
void quantize_act_blocks_avx512(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, int32_t* sum);
void quantize_act_blocks_avx2(const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, int32_t* sum);
void quantize_token_avx2(const float* x, int64_t K, float d, int qmin, int qmax, int8_t* q);  // K % 8 == 0
// quantize_sub_block32 over blocks [b0, b1) of x, vectorized (the same bytes)
void quantize_sub_blocks_avx2(const float* x, int64_t b0, int64_t b1, int sub, int bits, float ratio, int8_t* q,
                              float* d, int32_t* sum);
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

// Rounds x [K] to the nearest multiples of d clamped to [qmin, qmax] (half to even), K % 8 == 0: the
// per-token codes' inner loop, one per ISA path (all give the same bytes).
using RoundCodesFn = void (*)(const float* x, int64_t K, float d, int qmin, int qmax, int8_t* q);

// Sub-block activations (block-scaled A4 with blocks of `sub` = 8 or 16 features, two-level scales):
// each 32-feature block keeps one fp32 scale d and each sub-block j an integer multiplier k_j in
// [1, kmax], kmax = 127 / 2^(bits-1) (15 at 4 bits), so that k_j d approximates s_j = max|x| over the
// sub-block times float(clip / qmax), its own best scale: the largest s gets k = kb exactly (d = smax / kb)
// and kb in (kmax / 2, kmax] is the one whose worst relative mismatch |k_j d - s_j| / s_j is least
// (the first such from kmax down; k_j = clamp(round(s_j / d), 1, kmax)): the sub-scale ratios are then
// the best fractions with denominators up to kmax. Codes c = clamp(round(x / (k_j d)), -2^(bits-1),
// qmax) are stored as the int8 products k_j c (|k_j c| <= 120), so the per-32 int8 tile kernels
// multiply them unchanged: x ~ d * (k_j c), bit for bit act_codes.quantize_sub_blocks. One 32-block.
inline void quantize_sub_block32(const float* x, int sub, int bits, float ratio, RoundCodesFn round_codes, int8_t* q,
                                 float* d, int32_t* sum) {
  const int qmax = (1 << (bits - 1)) - 1, qmin = -qmax - 1, kmax = 127 / (qmax + 1), n = 32 / sub;
  float s[4], smax = 0.f;  // sub >= 8: at most 4 sub-blocks
  for (int j = 0; j < n; ++j) {
    float amax = 0.f;
    for (int i = 0; i < sub; ++i) amax = std::max(amax, std::fabs(x[j * sub + i]));
    s[j] = amax * ratio;
    smax = std::max(smax, s[j]);
  }
  int k[4] = {1, 1, 1, 1};
  float db = 1.f;
  if (smax > 0.f) {
    float best = INFINITY;
    for (int kb = kmax; kb > kmax / 2; --kb) {
      const float dc = smax / static_cast<float>(kb);
      int kc[4];
      float worst = 0.f;
      for (int j = 0; j < n; ++j) {
        const float kf = std::nearbyint(s[j] / dc);
        kc[j] = kf >= 1.f ? static_cast<int>(std::min<float>(kf, kmax)) : 1;  // (NaN from inf inputs: 1)
        if (s[j] > 0.f) worst = std::max(worst, std::fabs(static_cast<float>(kc[j]) * dc - s[j]) / s[j]);
      }
      if (worst < best) {
        best = worst;
        db = dc;
        std::copy(kc, kc + n, k);
      }
    }
  }
  int32_t total = 0;
  for (int j = 0; j < n; ++j) {
    int8_t* qj = q + j * sub;
    round_codes(x + j * sub, sub, static_cast<float>(k[j]) * db, qmin, qmax, qj);
    for (int i = 0; i < sub; ++i) {
      qj[i] = static_cast<int8_t>(k[j] * qj[i]);
      total += qj[i];
    }
  }
  *d = db;
  *sum = total;
}

// Per-token symmetric activations of `bits` bits (QuaRot's A8 / A4; fake_quantize_per_token in
// torch_lowbit/nn/act_quant.py is the twin): d = max|x| * (clip / (2^(bits-1) - 1)) per token (1 if 0),
// q = clamp(round_half_even(x / d), -2^(bits-1) (-127 at 8 bits), 2^(bits-1) - 1); every block of the
// token gets d.
void quantize_acts_per_token(const float* x, int64_t M, int64_t K, int bits, double clip, int8_t* q, float* d,
                             int32_t* sum);

// Sub-block activations (quantize_sub_block32) of x [M, K] (K % 32 == 0), sub 8 or 16, bits 2..4,
// threaded over blocks, with the active ISA path's rounding.
void quantize_acts_sub_blocks(const float* x, int64_t M, int64_t K, int sub, int bits, double clip, int8_t* q,
                              float* d, int32_t* sum);

}  // namespace torch_lowbit
