// Attention (decode and prefill) over a group-wise quantized KV cache (torch_lowbit/formats/kv.py layout):
// per cached token and KV head, codes (4-bit: two per byte, channel 2i low nibble; 8-bit: one per
// byte) and an fp16 scale d and min m per group of channels, value = code * d + m. A task is one
// (batch, KV head) and a block of `rows` query positions: its rows x G queries (G query heads per KV
// head) share every dequantized key and value row, which is rebuilt once in registers / L1 and used
// rows * G times (one position at decode; a block of the prompt at prefill).
#pragma once
#include <cstdint>
#include <limits>

namespace torch_lowbit {

constexpr int64_t kKvMaxQueries = 64;  // rows * G per task (the softmax state lives on the stack)
constexpr int kKvKeyBlock = 8;  // keys per block of the lane kernels (AVX2, NEON): one score vector per query
constexpr int64_t kKvScratchRows = kKvKeyBlock + 1;  // rebuilt rows per task: a key block and a zero row

// Scratch floats of a task of `queries` queries (rows * G) over L positions: the scores (by query, or
// key-major with the queries padded to 8 lanes), the prefill path's transposed queries and outputs,
// and the rebuilt rows.
inline int64_t kv_attention_scratch_floats(int64_t queries, int64_t L, int64_t D) {
  const int64_t padded = (queries + 7) / 8 * 8;
  return padded * (L + 2 * D) + kKvScratchRows * D;
}

struct KvAttentionTask {
  const float* q;          // query (row r, head g): q + r * q_row_stride + g * q_stride
  int64_t q_stride;
  int64_t rows = 1, q_row_stride = 0, mask_row_stride = 0, out_row_stride = 0;
  const uint8_t* k_codes;  // L rows of D * bits / 8 bytes
  const uint16_t* k_scale; // L rows of D / group fp16 values (raw bits)
  const uint16_t* k_min;
  const uint8_t* v_codes;
  const uint16_t* v_scale;
  const uint16_t* v_min;
  const float* mask;       // additive, or nullptr: mask + r * mask_row_stride + g * mask_head_stride + j * mask_key_stride
  int64_t mask_head_stride, mask_key_stride;
  float* out;              // output (row r, head g): out + r * out_row_stride + g * out_stride
  int64_t out_stride;
  int64_t G, L, D, group;
  int bits;
  float scale;
  float* scores;           // scratch: kv_attention_scratch_floats(rows * G, L, D) - kKvScratchRows * D floats
  float* row;              // scratch: kKvScratchRows * D floats
  // exact recent tokens (or nullptr): positions [recent_lo, recent_hi) read fp32 rows
  // k_recent + (j % recent_len) * D instead of their codes (a ring, as QuantizedKVLayer keeps it)
  const float* k_recent = nullptr;
  const float* v_recent = nullptr;
  int64_t recent_len = 0, recent_lo = 0, recent_hi = 0;

  // query h of the task (h < rows * G): position r = h / G, head g = h % G
  int64_t queries() const { return rows * G; }
  const float* query(int64_t h) const { return q + (h / G) * q_row_stride + (h % G) * q_stride; }
  float* output(int64_t h) const { return out + (h / G) * out_row_stride + (h % G) * out_stride; }
  // query h's mask row (key j at j * mask_key_stride), or nullptr
  const float* mask_row(int64_t h) const {
    return mask ? mask + (h / G) * mask_row_stride + (h % G) * mask_head_stride : nullptr;
  }
  float mask_at(int64_t h, int64_t j) const { return mask ? mask_row(h)[j * mask_key_stride] : 0.f; }
};

// The fp32 row of position j: the exact one from the ring where it holds j, else nullptr.
static inline const float* kv_recent_row(const float* ring, const KvAttentionTask& t, int64_t j) {
  return ring && j >= t.recent_lo && j < t.recent_hi ? ring + (j % t.recent_len) * t.D : nullptr;
}

// Rebuilds one cache row of D channels (code * d + m per group) into out.
using KvDequantRowFn = void (*)(const uint8_t* codes, const uint16_t* scale, const uint16_t* mn, int64_t D,
                                int64_t group, int bits, float* out);

// The rows of keys (or values) j0 .. j0 + n - 1 of a block of kKvKeyBlock: exact from the ring
// where it holds them, rebuilt into `tile` (row k at k * D) where some query uses them (`used`), else
// the zero row; rows[k] for k >= n is the zero row too.
inline void kv_block_rows(const KvAttentionTask& t, KvDequantRowFn dequant, const float* ring, const uint8_t* codes,
                          const uint16_t* scale, const uint16_t* mn, int64_t j0, int n, const bool* used, float* tile,
                          const float* zeros, const float** rows) {
  const int64_t row_bytes = t.D * t.bits / 8, groups = t.D / t.group;
  for (int k = 0; k < kKvKeyBlock; ++k) {
    rows[k] = zeros;
    if (k >= n || !used[k]) continue;
    if (const float* exact = kv_recent_row(ring, t, j0 + k)) {
      rows[k] = exact;
    } else {
      dequant(codes + (j0 + k) * row_bytes, scale + (j0 + k) * groups, mn + (j0 + k) * groups, t.D, t.group, t.bits,
              tile + k * t.D);
      rows[k] = tile + k * t.D;
    }
  }
}

// The query-lane layout of a task (the x86 prefill path, every ARM task): the scratch as scores
// [L][Qp] (key-major), qt [D][Qp] (the queries transposed, pre-scaled) and ot [D][Qp] (the outputs
// transposed, zeroed), Qp the queries padded to whole vectors of `lanes`; masks[h] each query's row.
struct KvLanes {
  int64_t Qp, vectors;
  float* scores;
  float* qt;
  float* ot;
};

inline KvLanes kv_lanes(const KvAttentionTask& t, int64_t lanes, const float** masks) {
  const int64_t Q = t.queries(), Qp = (Q + lanes - 1) / lanes * lanes;
  KvLanes l{Qp, Qp / lanes, t.scores, t.scores + t.L * Qp, t.scores + (t.L + t.D) * Qp};
  for (int64_t i = 0; i < 2 * t.D * Qp; ++i) l.qt[i] = 0.f;
  for (int64_t h = 0; h < Q; ++h) {
    const float* q = t.query(h);
    for (int64_t d = 0; d < t.D; ++d) l.qt[d * Qp + h] = q[d] * t.scale;
    masks[h] = t.mask_row(h);
  }
  return l;
}

// Scores of keys j0 .. j0 + n - 1 start as the mask values, queries h0 .. Q - 1 here (padding lanes:
// -inf with a mask, so they never count as seeing a key; 0 without).
inline void kv_lanes_mask(const KvAttentionTask& t, const KvLanes& l, const float* const* masks, int64_t j0, int n,
                          int64_t h0) {
  float* sb = l.scores + j0 * l.Qp;
  const float pad = t.mask ? -std::numeric_limits<float>::infinity() : 0.f;
  for (int k = 0; k < n; ++k) {
    for (int64_t h = h0; h < t.queries(); ++h) sb[k * l.Qp + h] = masks[h] ? masks[h][(j0 + k) * t.mask_key_stride] : 0.f;
    for (int64_t h = t.queries(); h < l.Qp; ++h) sb[k * l.Qp + h] = pad;
  }
}

// out(h)[d] = ot[d][h] * inv[h]
inline void kv_lanes_output(const KvAttentionTask& t, const KvLanes& l, const float* inv) {
  for (int64_t h = 0; h < t.queries(); ++h) {
    float* o = t.output(h);
    for (int64_t d = 0; d < t.D; ++d) o[d] = l.ot[d * l.Qp + h] * inv[h];
  }
}

void kv_attention_task_scalar(const KvAttentionTask& t);
#if defined(TORCH_LOWBIT_X86)
void kv_attention_task_avx2(const KvAttentionTask& t);  // needs group % 8 == 0 (so D % 8 == 0)
#endif
#if defined(__aarch64__)
void kv_attention_task_neon(const KvAttentionTask& t);  // needs group % 8 == 0 (so D % 8 == 0)
#endif

}  // namespace torch_lowbit
