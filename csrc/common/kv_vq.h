// Attention over a vector-quantized KV cache (CQ: torch_lowbit/formats/kv_vq.py): every cached token's
// key (value) of a KV head is cut into channel groups of `vec` channels, each stored as one byte,
// the entry of its group's codebook (fp16 planes [groups, vec, E] per KV head: coordinate d of every
// entry contiguous). The kernel never rebuilds a key or a value:
// - scores: per query, a table of every entry's dot product with the query's group, then a token's
//   score is the sum of its groups' table entries (one lookup per group instead of vec multiply-adds);
// - values: the softmax weights are summed per (group, entry) into a histogram, and the output is
//   the histogram times the value codebook (E x vec multiply-adds per group, not one per token).
// A task is one query (batch, head, row); its G queries of a KV head share the codes in cache.
#pragma once
#include <c10/util/Half.h>

#include <cstdint>

namespace torch_lowbit {

struct KvVqTask {
  const float* q;               // D
  const uint8_t* k_codes;       // [L, groups]
  const uint8_t* v_codes;
  const c10::Half* k_planes;    // [groups, vec, E]
  const c10::Half* v_planes;
  const float* mask;            // additive, key j at mask[j * mask_key_stride], or nullptr
  int64_t mask_key_stride;
  float* out;                   // D
  int64_t L, D, vec, E, groups;
  float scale;
  float* scratch;               // kv_vq_scratch_floats
};

inline int64_t kv_vq_scratch_floats(int64_t L, int64_t groups, int64_t E) { return L + 2 * groups * E; }

void kv_vq_task_scalar(const KvVqTask& t);
#if defined(TORCH_LOWBIT_X86)
void kv_vq_task_avx2(const KvVqTask& t);
#endif

}  // namespace torch_lowbit
