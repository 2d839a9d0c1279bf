// NEON KV-cache attention: the task of common/kv_attention_scalar.cpp with the queries in the vector
// lanes (the scheme of x86/kv_attention_avx2.cpp's prefill path, 4 lanes), for decode and prefill
// alike: the task's queries are transposed once (pre-scaled, qt[d][h]), the scores kept key-major
// (s[j][h]), and both products run in register tiles of up to 4 query vectors x 4 keys (4 channels),
// 16 accumulators of AArch64's 32 vector registers; the softmax runs over the query lanes. A 4-bit
// row is rebuilt 8 channels at a time: the 4 code bytes' low and high nibbles zipped into channel
// order, widened, converted and scaled (code * d + m). Keys no query sees (mask at or below
// finfo.min) are never rebuilt, value rows whose every weight is 0 neither.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "common/kv_attention.h"

namespace torch_lowbit {
namespace {

inline float half_to_float(uint16_t h) {
  __fp16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

void dequant_row(const uint8_t* codes, const uint16_t* scale, const uint16_t* mn, int64_t D, int64_t group, int bits,
                 float* out) {
  for (int64_t g0 = 0; g0 < D; g0 += group) {
    const float32x4_t d = vdupq_n_f32(half_to_float(scale[g0 / group]));
    const float32x4_t m = vdupq_n_f32(half_to_float(mn[g0 / group]));
    for (int64_t i = g0; i < g0 + group; i += 8) {
      uint8x8_t c;
      if (bits == 4) {
        uint32_t word;
        std::memcpy(&word, codes + i / 2, 4);
        const uint8x8_t b = vcreate_u8(word);
        c = vzip1_u8(vand_u8(b, vdup_n_u8(15)), vshr_n_u8(b, 4));  // channel 2i: low nibble of byte i
      } else {
        c = vld1_u8(codes + i);
      }
      const uint16x8_t w = vmovl_u8(c);
      vst1q_f32(out + i, vfmaq_f32(m, vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))), d));
      vst1q_f32(out + i + 4, vfmaq_f32(m, vcvtq_f32_u32(vmovl_u16(vget_high_u16(w))), d));
    }
  }
}

// e^x for 4 lanes: Cephes' expf as x86's exp256 (relative error ~2e-7); lanes below -88.38 give 0.
inline float32x4_t exp4(float32x4_t x) {
  const uint32x4_t underflows = vcltq_f32(x, vdupq_n_f32(-88.3762626647949f));
  x = vmaxq_f32(vminq_f32(x, vdupq_n_f32(88.3762626647949f)), vdupq_n_f32(-88.3762626647949f));
  const float32x4_t fx = vrndmq_f32(vfmaq_f32(vdupq_n_f32(0.5f), x, vdupq_n_f32(1.44269504088896341f)));
  x = vfmsq_f32(x, fx, vdupq_n_f32(0.693359375f));
  x = vfmsq_f32(x, fx, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t y = vdupq_n_f32(1.9875691500E-4f);
  y = vfmaq_f32(vdupq_n_f32(1.3981999507E-3f), y, x);
  y = vfmaq_f32(vdupq_n_f32(8.3334519073E-3f), y, x);
  y = vfmaq_f32(vdupq_n_f32(4.1665795894E-2f), y, x);
  y = vfmaq_f32(vdupq_n_f32(1.6666665459E-1f), y, x);
  y = vfmaq_f32(vdupq_n_f32(5.0000001201E-1f), y, x);
  y = vfmaq_f32(vaddq_f32(x, vdupq_n_f32(1.f)), y, vmulq_f32(x, x));
  const int32x4_t pow2n = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(fx), vdupq_n_s32(127)), 23);
  return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(vmulq_f32(y, vreinterpretq_f32_s32(pow2n))), underflows));
}

// s[k0 + k][v * 4 ..] += qt · key rows[k0 + k] for k < 4 (stored for k0 + k < n), query vectors v0 .. v0 + NV - 1
template <int NV>
inline void lane_scores(const float* qt, int64_t Qp, int64_t D, const float* const* rows, int k0, int n, float* s,
                        int64_t v0) {
  float32x4_t acc[NV][4];
  for (int i = 0; i < NV; ++i)
    for (int k = 0; k < 4; ++k) acc[i][k] = vdupq_n_f32(0.f);
  const float* qd = qt + v0 * 4;
  for (int64_t d = 0; d < D; ++d, qd += Qp) {
    float32x4_t qv[NV];
    for (int i = 0; i < NV; ++i) qv[i] = vld1q_f32(qd + i * 4);
    for (int k = 0; k < 4; ++k) {
      const float32x4_t b = vld1q_dup_f32(rows[k0 + k] + d);
      for (int i = 0; i < NV; ++i) acc[i][k] = vfmaq_f32(acc[i][k], qv[i], b);
    }
  }
  for (int k = 0; k < 4 && k0 + k < n; ++k)
    for (int i = 0; i < NV; ++i) {
      float* p = s + (k0 + k) * Qp + (v0 + i) * 4;
      vst1q_f32(p, vaddq_f32(vld1q_f32(p), acc[i][k]));
    }
}

// ot[d .. d + 3][v * 4 ..] += p[k] x value rows[k][d .. d + 3] over the block's 8 keys
template <int NV>
inline void lane_values(const float* p, int64_t Qp, const float* const* rows, int64_t d, float* ot, int64_t v0) {
  float32x4_t acc[NV][4];
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < NV; ++i) acc[i][c] = vld1q_f32(ot + (d + c) * Qp + (v0 + i) * 4);
  for (int k = 0; k < kKvKeyBlock; ++k) {
    float32x4_t pv[NV];
    for (int i = 0; i < NV; ++i) pv[i] = vld1q_f32(p + k * Qp + (v0 + i) * 4);
    const float32x4_t r = vld1q_f32(rows[k] + d);  // channels d .. d + 3: one load, a lane per FMA
    for (int i = 0; i < NV; ++i) {
      acc[i][0] = vfmaq_laneq_f32(acc[i][0], pv[i], r, 0);
      acc[i][1] = vfmaq_laneq_f32(acc[i][1], pv[i], r, 1);
      acc[i][2] = vfmaq_laneq_f32(acc[i][2], pv[i], r, 2);
      acc[i][3] = vfmaq_laneq_f32(acc[i][3], pv[i], r, 3);
    }
  }
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < NV; ++i) vst1q_f32(ot + (d + c) * Qp + (v0 + i) * 4, acc[i][c]);
}

// Query vectors 0 .. nv - 1 in register tiles of 4, the rest in one tile of 1-3.
template <typename F>
inline void over_query_tiles(int64_t nv, F f) {
  int64_t v = 0;
  for (; v + 4 <= nv; v += 4) f(v, std::integral_constant<int, 4>());
  switch (nv - v) {
    case 3: f(v, std::integral_constant<int, 3>()); break;
    case 2: f(v, std::integral_constant<int, 2>()); break;
    case 1: f(v, std::integral_constant<int, 1>()); break;
    default: break;
  }
}

void run_lane_task(const KvAttentionTask& t) {
  const float neg_inf = -std::numeric_limits<float>::infinity(), lowest = std::numeric_limits<float>::lowest();
  const int64_t L = t.L, D = t.D;
  const float* masks[kKvMaxQueries];
  const KvLanes lanes = kv_lanes(t, 4, masks);
  const int64_t Qp = lanes.Qp, nv = lanes.vectors;
  float* s = lanes.scores;
  float* qt = lanes.qt;
  float* ot = lanes.ot;
  float* tile = t.row;
  float* zeros = t.row + kKvKeyBlock * D;
  std::memset(zeros, 0, D * sizeof(float));
  const float32x4_t lowest_v = vdupq_n_f32(lowest);
  float32x4_t mxv[kKvMaxQueries / 4];
  for (int64_t v = 0; v < nv; ++v) mxv[v] = vdupq_n_f32(neg_inf);
  const float* rows[kKvKeyBlock];
  bool used[kKvKeyBlock];
  for (int64_t j0 = 0; j0 < L; j0 += kKvKeyBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kKvKeyBlock, L - j0));
    float* sb = s + j0 * Qp;
    kv_lanes_mask(t, lanes, masks, j0, n, 0);  // the block's scores start as the mask values
    int seen = 0;
    for (int k = 0; k < n; ++k) {
      uint32x4_t any = vdupq_n_u32(0);
      for (int64_t v = 0; v < nv; ++v) any = vorrq_u32(any, vcgtq_f32(vld1q_f32(sb + k * Qp + v * 4), lowest_v));
      seen |= (vmaxvq_u32(any) != 0) << k;
    }
    if (!seen) continue;
    for (int k = 0; k < kKvKeyBlock; ++k) used[k] = (seen >> k) & 1;
    kv_block_rows(t, dequant_row, t.k_recent, t.k_codes, t.k_scale, t.k_min, j0, n, used, tile, zeros, rows);
    for (int k0 = 0; k0 < n; k0 += 4)
      over_query_tiles(nv, [&](int64_t v, auto nv_tile) { lane_scores<decltype(nv_tile)::value>(qt, Qp, D, rows, k0, n, sb, v); });
    for (int k = 0; k < n; ++k)
      for (int64_t v = 0; v < nv; ++v) mxv[v] = vmaxq_f32(mxv[v], vld1q_f32(sb + k * Qp + v * 4));
  }
  // softmax numerators over the query lanes; a lane whose every key is -inf gets no weight anywhere
  // (its output comes out NaN, as softmax's)
  float32x4_t total[kKvMaxQueries / 4];
  uint32x4_t dead[kKvMaxQueries / 4];
  for (int64_t v = 0; v < nv; ++v) {
    dead[v] = vceqq_f32(mxv[v], vdupq_n_f32(neg_inf));
    mxv[v] = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(mxv[v]), dead[v]));  // 0 there
    total[v] = vdupq_n_f32(0.f);
  }
  for (int64_t j = 0; j < L; ++j)
    for (int64_t v = 0; v < nv; ++v) {
      float* p = s + j * Qp + v * 4;
      const float32x4_t e = vreinterpretq_f32_u32(
          vbicq_u32(vreinterpretq_u32_f32(exp4(vsubq_f32(vld1q_f32(p), mxv[v]))), dead[v]));
      vst1q_f32(p, e);
      total[v] = vaddq_f32(total[v], e);
    }
  for (int64_t j0 = 0; j0 < L; j0 += kKvKeyBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kKvKeyBlock, L - j0));
    const float* pb = s + j0 * Qp;
    bool any = false;
    for (int k = 0; k < kKvKeyBlock; ++k) {
      used[k] = false;
      for (int64_t v = 0; k < n && v < nv && !used[k]; ++v)
        used[k] = vmaxvq_u32(vmvnq_u32(vceqq_f32(vld1q_f32(pb + k * Qp + v * 4), vdupq_n_f32(0.f)))) != 0;
      any |= used[k];
    }
    if (!any) continue;
    kv_block_rows(t, dequant_row, t.v_recent, t.v_codes, t.v_scale, t.v_min, j0, n, used, tile, zeros, rows);
    float tail[kKvKeyBlock * kKvMaxQueries];  // a ragged last block: its missing keys weigh 0
    if (n < kKvKeyBlock) {
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, pb, n * Qp * sizeof(float));
      pb = tail;
    }
    for (int64_t d = 0; d < D; d += 4)
      over_query_tiles(nv, [&](int64_t v, auto nv_tile) { lane_values<decltype(nv_tile)::value>(pb, Qp, rows, d, ot, v); });
  }
  float inv[kKvMaxQueries];
  for (int64_t v = 0; v < nv; ++v) {
    const uint32x4_t ok = vcgtq_f32(total[v], vdupq_n_f32(0.f));
    const float32x4_t r = vdivq_f32(vdupq_n_f32(1.f), total[v]);
    vst1q_f32(inv + v * 4, vbslq_f32(ok, r, vdupq_n_f32(std::numeric_limits<float>::quiet_NaN())));
  }
  kv_lanes_output(t, lanes, inv);
}

}  // namespace

void kv_attention_task_neon(const KvAttentionTask& t) { run_lane_task(t); }

}  // namespace torch_lowbit
#endif  // __aarch64__
