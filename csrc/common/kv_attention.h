// Decode attention over a group-wise quantized KV cache (torch_lowbit/formats/kv.py layout):
// per cached token and KV head, codes (4-bit: two per byte, channel 2i low nibble; 8-bit: one per
// byte) and an fp16 scale d and min m per group of channels, value = code * d + m. A task is one
// (batch, KV head, query position): its G query heads share every dequantized key and value row,
// which is rebuilt once in registers / L1 and used G times.
#pragma once
#include <cstdint>

namespace torch_lowbit {

struct KvAttentionTask {
  const float* q;          // G query rows, q + g * q_stride
  int64_t q_stride;
  const uint8_t* k_codes;  // L rows of D * bits / 8 bytes
  const uint16_t* k_scale; // L rows of D / group fp16 values (raw bits)
  const uint16_t* k_min;
  const uint8_t* v_codes;
  const uint16_t* v_scale;
  const uint16_t* v_min;
  const float* mask;       // additive, or nullptr: mask + g * mask_head_stride + j * mask_key_stride
  int64_t mask_head_stride, mask_key_stride;
  float* out;              // G output rows, out + g * out_stride
  int64_t out_stride;
  int64_t G, L, D, group;
  int bits;
  float scale;
  float* scores;           // scratch: G * L floats
  float* row;              // scratch: D floats
  // exact recent tokens (or nullptr): positions [recent_lo, recent_hi) read fp32 rows
  // k_recent + (j % recent_len) * D instead of their codes (a ring, as QuantizedKVLayer keeps it)
  const float* k_recent = nullptr;
  const float* v_recent = nullptr;
  int64_t recent_len = 0, recent_lo = 0, recent_hi = 0;
};

// The fp32 row of position j: the exact one from the ring where it holds j, else nullptr.
static inline const float* kv_recent_row(const float* ring, const KvAttentionTask& t, int64_t j) {
  return ring && j >= t.recent_lo && j < t.recent_hi ? ring + (j % t.recent_len) * t.D : nullptr;
}

void kv_attention_task_scalar(const KvAttentionTask& t);
#if defined(TORCH_LOWBIT_X86)
void kv_attention_task_avx2(const KvAttentionTask& t);  // needs group % 8 == 0
#endif

}  // namespace torch_lowbit
