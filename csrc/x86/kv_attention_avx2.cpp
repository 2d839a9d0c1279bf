// AVX2 KV-cache attention (the task of common/kv_attention_scalar.cpp, in blocks of 8 keys). A 4-bit row is
// rebuilt 8 channels at a time: the 4 code bytes are broadcast to 8 lanes and shifted right by
// 0, 4, ..., 28 (vpsrlvd), which puts channel i's nibble in lane i (low nibble = even channel);
// masked, converted and scaled with one FMA (code * d + m). 8-bit rows: vpmovzxbd. The rebuilt row
// stays in L1 and is used by every query of the task (G heads x a block of positions).
#if defined(TORCH_LOWBIT_X86)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/kv_attention.h"  // before the target pragma: shared inline code stays baseline x86-64
#include "x86/softmax_avx2.h"

// The rest of the file is AVX2 code.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#define TLB_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace torch_lowbit {
namespace {

TLB_AVX2 inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

TLB_AVX2 void avx2_dequant_row(const uint8_t* codes, const uint16_t* scale, const uint16_t* mn, int64_t D, int64_t group,
                          int bits, float* out) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nib = _mm256_set1_epi32(15);
  for (int64_t g0 = 0; g0 < D; g0 += group) {
    const __m256 d = _mm256_set1_ps(half_to_float(scale[g0 / group]));
    const __m256 m = _mm256_set1_ps(half_to_float(mn[g0 / group]));
    for (int64_t i = g0; i < g0 + group; i += 8) {
      __m256i c;
      if (bits == 4) {
        uint32_t word;
        std::memcpy(&word, codes + i / 2, 4);
        c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts), nib);
      } else {
        c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
      }
      _mm256_storeu_ps(out + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), d, m));
    }
  }
}


// One task (common/kv_attention_scalar.cpp's passes) in blocks of 8 keys: per query and block, the 8
// scores are 8 accumulators over D (a query vector and 8 key rows per step) summed into one vector,
// and the value pass adds 8 weighted value rows per output load / store. Each rebuilt row of the block
// serves all rows * G queries of the task (the register-blocked prefill; one position at decode).
TLB_AVX2 void run_blocked_task(const KvAttentionTask& t) {
  const float neg_inf = -std::numeric_limits<float>::infinity(), lowest = std::numeric_limits<float>::lowest();
  const int64_t Q = t.queries(), L = t.L, D = t.D;
  float mx[kKvMaxQueries], total[kKvMaxQueries];
  float* tile = t.row;  // kKvScratchRows * D: 8 rebuilt rows, then a zero row
  float* zeros = t.row + kKvKeyBlock * D;
  std::memset(zeros, 0, D * sizeof(float));
  const float* rows[kKvKeyBlock];
  bool used[kKvKeyBlock];
  const __m256 scale = _mm256_set1_ps(t.scale);
  const float* queries[kKvMaxQueries];
  const float* masks[kKvMaxQueries];
  float* outputs[kKvMaxQueries];
  __m256 mxv[kKvMaxQueries];  // the running max of each query's scores: one lane per key of a block
  for (int64_t h = 0; h < Q; ++h) {
    mx[h] = neg_inf;
    mxv[h] = _mm256_set1_ps(neg_inf);
    queries[h] = t.query(h);
    outputs[h] = t.output(h);
    masks[h] = t.mask_row(h);
  }
  const int64_t mask_step = t.mask_key_stride;
  for (int64_t j0 = 0; j0 < L; j0 += kKvKeyBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kKvKeyBlock, L - j0));
    int seen = 0;  // bit k: some query sees key j0 + k
    if (n == kKvKeyBlock && mask_step == 1) {  // 8 contiguous mask values per query
      for (int64_t h = 0; h < Q; ++h) {
        const __m256 m = masks[h] ? _mm256_loadu_ps(masks[h] + j0) : _mm256_setzero_ps();
        _mm256_storeu_ps(t.scores + h * L + j0, m);
        seen |= _mm256_movemask_ps(_mm256_cmp_ps(m, _mm256_set1_ps(lowest), _CMP_GT_OQ));
      }
    } else {
      for (int64_t h = 0; h < Q; ++h) {
        float* s = t.scores + h * L + j0;
        for (int k = 0; k < n; ++k) {
          s[k] = masks[h] ? masks[h][(j0 + k) * mask_step] : 0.f;
          seen |= (s[k] > lowest) << k;
        }
      }
    }
    for (int k = 0; k < kKvKeyBlock; ++k) used[k] = (seen >> k) & 1;
    const bool any = seen != 0;
    // keys no query sees are never rebuilt (a static cache's unfilled positions, a prompt block's
    // future): masked by -inf, or by finfo.min as transformers does, where finfo.min + q·k rounds
    // to finfo.min for any |q·k| < 1e31, so the score is the mask value without the product
    if (!any) continue;
    kv_block_rows(t, avx2_dequant_row, t.k_recent, t.k_codes, t.k_scale, t.k_min, j0, n, used, tile, zeros, rows);
    for (int64_t h = 0; h < Q; ++h) {
      const float* q = queries[h];
      __m256 acc[kKvKeyBlock];
      for (int k = 0; k < kKvKeyBlock; ++k) acc[k] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int k = 0; k < kKvKeyBlock; ++k) acc[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[k] + d), acc[k]);
      }
      const __m256 dots = _mm256_mul_ps(sums8(acc), scale);
      float* s = t.scores + h * L + j0;
      if (n == kKvKeyBlock) {  // masked keys keep their mask value: -inf or finfo.min + a finite dot
        const __m256 sv = _mm256_add_ps(_mm256_loadu_ps(s), dots);
        _mm256_storeu_ps(s, sv);
        mxv[h] = _mm256_max_ps(mxv[h], sv);
      } else {
        alignas(32) float d8[kKvKeyBlock];
        _mm256_store_ps(d8, dots);
        float m = mx[h];
        for (int k = 0; k < n; ++k) {
          s[k] += d8[k];
          m = s[k] > m ? s[k] : m;
        }
        mx[h] = m;
      }
    }
  }
  for (int64_t h = 0; h < Q; ++h) {
    alignas(32) float lanes[kKvKeyBlock];
    _mm256_store_ps(lanes, mxv[h]);
    for (float v : lanes) mx[h] = v > mx[h] ? v : mx[h];
    std::memset(outputs[h], 0, D * sizeof(float));
    if (mx[h] == neg_inf) {  // every key masked: no weight anywhere (the row comes out NaN, as softmax's)
      std::memset(t.scores + h * L, 0, L * sizeof(float));
      total[h] = 0.f;
    } else {
      total[h] = avx2_numerators(t.scores + h * L, L, mx[h]);
    }
  }
  for (int64_t j0 = 0; j0 < L; j0 += kKvKeyBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kKvKeyBlock, L - j0));
    bool any = false;
    for (int k = 0; k < n; ++k) {
      used[k] = false;
      for (int64_t h = 0; h < Q && !used[k]; ++h) used[k] = t.scores[h * L + j0 + k] != 0.f;
      any |= used[k];
    }
    if (!any) continue;
    kv_block_rows(t, avx2_dequant_row, t.v_recent, t.v_codes, t.v_scale, t.v_min, j0, n, used, tile, zeros, rows);
    for (int64_t h = 0; h < Q; ++h) {
      const float* e = t.scores + h * L + j0;
      __m256 ev[kKvKeyBlock];
      bool nonzero = false;
      for (int k = 0; k < kKvKeyBlock; ++k) {
        const float ek = k < n ? e[k] : 0.f;
        nonzero |= ek != 0.f;
        ev[k] = _mm256_set1_ps(ek);
      }
      if (!nonzero) continue;
      float* o = outputs[h];
      int64_t d = 0;
      for (; d + 32 <= D; d += 32) {  // four independent FMA chains (one chain would wait on FMA latency)
        __m256 acc[4];
        for (int c = 0; c < 4; ++c) acc[c] = _mm256_loadu_ps(o + d + 8 * c);
        for (int k = 0; k < kKvKeyBlock; ++k)
          for (int c = 0; c < 4; ++c) acc[c] = _mm256_fmadd_ps(ev[k], _mm256_loadu_ps(rows[k] + d + 8 * c), acc[c]);
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o + d + 8 * c, acc[c]);
      }
      for (; d < D; d += 8) {
        __m256 acc0 = _mm256_loadu_ps(o + d), acc1 = _mm256_setzero_ps();
        for (int k = 0; k < kKvKeyBlock; k += 2) {
          acc0 = _mm256_fmadd_ps(ev[k], _mm256_loadu_ps(rows[k] + d), acc0);
          acc1 = _mm256_fmadd_ps(ev[k + 1], _mm256_loadu_ps(rows[k + 1] + d), acc1);
        }
        _mm256_storeu_ps(o + d, _mm256_add_ps(acc0, acc1));
      }
    }
  }
  for (int64_t h = 0; h < Q; ++h) {
    const __m256 inv = _mm256_set1_ps(total[h] > 0.f ? 1.f / total[h] : std::numeric_limits<float>::quiet_NaN());
    float* o = outputs[h];
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
  }
}

// ---- Prefill tasks (many queries): queries in the vector lanes ---------------------------------------
// With rows x G >= kLaneQueries queries, a task works like a small GEMM with the queries in the lanes:
// the queries are transposed once (qt[d][h], pre-scaled), a score vector holds 8 queries' scores of one
// key (scores key-major, s[j][h]) and the value pass accumulates ot[d][h]. Each step loads a few query
// (or probability) vectors and broadcasts a few key (or value) elements into a register tile of
// 2 query vectors x 4 keys (4 channels): 8 FMAs for 6 loads, where the per-query dot products above
// take 9 loads for 8 FMAs plus a horizontal-add tree per block. The softmax runs over query lanes too.
constexpr int64_t kLaneQueries = 16;

TLB_AVX2 inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// scores of keys rows[k0 .. k0 + 3] for query vectors v0 .. v0 + NV - 1: s[j0 + k][v * 8 ..] += qt · key
template <int NV>
TLB_AVX2 inline void lane_scores(const float* qt, int64_t Qp, int64_t D, const float* const* rows, int k0, int n,
                                 float* s, int64_t v0) {
  __m256 acc[NV][4];
  for (int i = 0; i < NV; ++i)
    for (int k = 0; k < 4; ++k) acc[i][k] = _mm256_setzero_ps();
  const float* r0 = rows[k0];
  const float* r1 = rows[k0 + 1];
  const float* r2 = rows[k0 + 2];
  const float* r3 = rows[k0 + 3];
  const float* qd = qt + v0 * 8;
  for (int64_t d = 0; d < D; ++d, qd += Qp) {
    __m256 qv[NV];
    for (int i = 0; i < NV; ++i) qv[i] = _mm256_loadu_ps(qd + i * 8);
    const __m256 b0 = _mm256_broadcast_ss(r0 + d), b1 = _mm256_broadcast_ss(r1 + d);
    const __m256 b2 = _mm256_broadcast_ss(r2 + d), b3 = _mm256_broadcast_ss(r3 + d);
    for (int i = 0; i < NV; ++i) {
      acc[i][0] = _mm256_fmadd_ps(qv[i], b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(qv[i], b1, acc[i][1]);
      acc[i][2] = _mm256_fmadd_ps(qv[i], b2, acc[i][2]);
      acc[i][3] = _mm256_fmadd_ps(qv[i], b3, acc[i][3]);
    }
  }
  for (int k = 0; k < 4 && k0 + k < n; ++k)
    for (int i = 0; i < NV; ++i) {
      float* p = s + (k0 + k) * Qp + (v0 + i) * 8;
      _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), acc[i][k]));
    }
}

// ot[d .. d + 3][v * 8 ..] += p[k] (8 keys' probability vectors) x value rows[k][d .. d + 3]
template <int NV>
TLB_AVX2 inline void lane_values(const float* p, int64_t Qp, const float* const* rows, int64_t d, float* ot,
                                 int64_t v0) {
  __m256 acc[NV][4];
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < NV; ++i) acc[i][c] = _mm256_loadu_ps(ot + (d + c) * Qp + (v0 + i) * 8);
  for (int k = 0; k < kKvKeyBlock; ++k) {
    __m256 pv[NV];
    for (int i = 0; i < NV; ++i) pv[i] = _mm256_loadu_ps(p + k * Qp + (v0 + i) * 8);
    const float* r = rows[k] + d;
    const __m256 b0 = _mm256_broadcast_ss(r), b1 = _mm256_broadcast_ss(r + 1);
    const __m256 b2 = _mm256_broadcast_ss(r + 2), b3 = _mm256_broadcast_ss(r + 3);
    for (int i = 0; i < NV; ++i) {
      acc[i][0] = _mm256_fmadd_ps(pv[i], b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(pv[i], b1, acc[i][1]);
      acc[i][2] = _mm256_fmadd_ps(pv[i], b2, acc[i][2]);
      acc[i][3] = _mm256_fmadd_ps(pv[i], b3, acc[i][3]);
    }
  }
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(ot + (d + c) * Qp + (v0 + i) * 8, acc[i][c]);
}

// Query vectors v = 0 .. nv - 1 in register tiles of 2 (the last of 1 where nv is odd): 8 accumulators,
// 2 query vectors and 4 broadcasts fit AVX2's 16 registers (a tile of 3 did not: GCC re-read the query
// vectors from memory in every FMA, 16 loads per 12 FMAs, and spilled the value tile).
template <typename F2, typename F1>
TLB_AVX2 inline void over_query_tiles(int64_t nv, F2 f2, F1 f1) {
  int64_t v = 0;
  for (; v + 2 <= nv; v += 2) f2(v);
  if (v < nv) f1(v);
}

TLB_AVX2 void run_lane_task(const KvAttentionTask& t) {
  const float neg_inf = -std::numeric_limits<float>::infinity(), lowest = std::numeric_limits<float>::lowest();
  const int64_t Q = t.queries(), L = t.L, D = t.D;
  const float* masks[kKvMaxQueries];
  const KvLanes lanes = kv_lanes(t, 8, masks);
  const int64_t Qp = lanes.Qp, nv = lanes.vectors;
  float* s = lanes.scores;
  float* qt = lanes.qt;
  float* ot = lanes.ot;
  float* tile = t.row;
  float* zeros = t.row + kKvKeyBlock * D;
  std::memset(zeros, 0, D * sizeof(float));
  const int64_t step = t.mask_key_stride;
  const __m256 lowest_v = _mm256_set1_ps(lowest);
  __m256 mxv[kKvMaxQueries / 8];
  for (int64_t v = 0; v < nv; ++v) mxv[v] = _mm256_set1_ps(neg_inf);
  const float* rows[kKvKeyBlock];
  bool used[kKvKeyBlock];
  for (int64_t j0 = 0; j0 < L; j0 += kKvKeyBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kKvKeyBlock, L - j0));
    float* sb = s + j0 * Qp;
    // the block's scores start as the mask values (8 x 8 transposes where 8 queries' rows are contiguous)
    if (!t.mask) {
      std::memset(sb, 0, n * Qp * sizeof(float));
    } else {
      int64_t h0 = 0;
      if (n == kKvKeyBlock && step == 1)
        for (; h0 + 8 <= Q; h0 += 8) {
          __m256 r[8];
          for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(masks[h0 + i] + j0);
          transpose8(r);
          for (int k = 0; k < 8; ++k) _mm256_storeu_ps(sb + k * Qp + h0, r[k]);
        }
      kv_lanes_mask(t, lanes, masks, j0, n, h0);
    }
    int seen = 0;  // keys no query sees (mask at or below finfo.min) are never rebuilt, as above
    for (int k = 0; k < n; ++k) {
      __m256 any = _mm256_setzero_ps();
      for (int64_t v = 0; v < nv; ++v) any = _mm256_or_ps(any, _mm256_cmp_ps(_mm256_loadu_ps(sb + k * Qp + v * 8), lowest_v, _CMP_GT_OQ));
      seen |= (_mm256_movemask_ps(any) != 0) << k;
    }
    if (!seen) continue;
    for (int k = 0; k < kKvKeyBlock; ++k) used[k] = (seen >> k) & 1;
    kv_block_rows(t, avx2_dequant_row, t.k_recent, t.k_codes, t.k_scale, t.k_min, j0, n, used, tile, zeros, rows);
    for (int k0 = 0; k0 < n; k0 += 4)
      over_query_tiles(nv, [&](int64_t v) { lane_scores<2>(qt, Qp, D, rows, k0, n, sb, v); },
                       [&](int64_t v) { lane_scores<1>(qt, Qp, D, rows, k0, n, sb, v); });
    for (int k = 0; k < n; ++k)
      for (int64_t v = 0; v < nv; ++v) mxv[v] = _mm256_max_ps(mxv[v], _mm256_loadu_ps(sb + k * Qp + v * 8));
  }
  // softmax numerators over the query lanes; a lane whose every key is -inf gets no weight anywhere
  // (its output comes out NaN, as softmax's)
  __m256 total[kKvMaxQueries / 8];
  __m256 dead[kKvMaxQueries / 8];
  for (int64_t v = 0; v < nv; ++v) {
    dead[v] = _mm256_cmp_ps(mxv[v], _mm256_set1_ps(neg_inf), _CMP_EQ_OQ);
    mxv[v] = _mm256_andnot_ps(dead[v], mxv[v]);  // 0 there: exp(-inf - 0) stays 0, no NaN
    total[v] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < L; ++j)
    for (int64_t v = 0; v < nv; ++v) {
      float* p = s + j * Qp + v * 8;
      const __m256 e = _mm256_andnot_ps(dead[v], exp256(_mm256_sub_ps(_mm256_loadu_ps(p), mxv[v])));
      _mm256_storeu_ps(p, e);
      total[v] = _mm256_add_ps(total[v], e);
    }
  for (int64_t j0 = 0; j0 < L; j0 += kKvKeyBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kKvKeyBlock, L - j0));
    const float* pb = s + j0 * Qp;
    bool any = false;
    for (int k = 0; k < kKvKeyBlock; ++k) {
      used[k] = false;
      for (int64_t v = 0; k < n && v < nv && !used[k]; ++v)
        used[k] = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(pb + k * Qp + v * 8), _mm256_setzero_ps(), _CMP_NEQ_UQ)) != 0;
      any |= used[k];
    }
    if (!any) continue;
    kv_block_rows(t, avx2_dequant_row, t.v_recent, t.v_codes, t.v_scale, t.v_min, j0, n, used, tile, zeros, rows);
    alignas(32) float tail[kKvKeyBlock * kKvMaxQueries];  // a ragged last block: its missing keys weigh 0
    if (n < kKvKeyBlock) {
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, pb, n * Qp * sizeof(float));
      pb = tail;
    }
    for (int64_t d = 0; d < D; d += 4)
      over_query_tiles(nv, [&](int64_t v) { lane_values<2>(pb, Qp, rows, d, ot, v); },
                       [&](int64_t v) { lane_values<1>(pb, Qp, rows, d, ot, v); });
  }
  alignas(32) float inv[kKvMaxQueries];
  for (int64_t v = 0; v < nv; ++v) {
    const __m256 ok = _mm256_cmp_ps(total[v], _mm256_setzero_ps(), _CMP_GT_OQ);
    const __m256 r = _mm256_div_ps(_mm256_set1_ps(1.f), total[v]);
    _mm256_store_ps(inv + v * 8, _mm256_blendv_ps(_mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), r, ok));
  }
  kv_lanes_output(t, lanes, inv);
}

}  // namespace

// Decode (few queries per task): per-query dot products; prefill blocks: queries in the lanes.
void kv_attention_task_avx2(const KvAttentionTask& t) {
  if (t.queries() >= kLaneQueries) run_lane_task(t);
  else run_blocked_task(t);
}
#pragma GCC pop_options

}  // namespace torch_lowbit
#endif  // TORCH_LOWBIT_X86
