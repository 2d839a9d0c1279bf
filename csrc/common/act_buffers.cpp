#include "common/act_buffers.h"

namespace torch_lowbit {

ActBuffers quantize_activations(const char* op, const at::Tensor& x2, int64_t group, int64_t act_bits,
                                double act_clip, int64_t act_block, bool with_mins, bool per_token_sums,
                                bool half_sums, const at::Tensor& into) {
  TORCH_CHECK(act_bits == 0 || act_bits == 8 || act_bits == 4 || act_bits == 3 || act_bits == 2, op,
              ": act_bits must be 0 (per-32 int8 blocks) or 8, 4, 3, 2 (per token), got ", act_bits);
  TORCH_CHECK(act_bits == 0 || (act_clip > 0 && act_clip <= 1), op, ": act_clip must be in (0, 1], got ", act_clip);
  const bool sub_blocks = act_block == 8 || act_block == 16;
  TORCH_CHECK(act_block == 0 || ((act_block == kActBlock || sub_blocks) && act_bits != 0), op,
              ": act_block must be 0 (one scale per token), 32 (one per block of 32 features) or 16 / 8 (two-level "
              "scales inside each block of 32), with act_bits; got act_block=", act_block, " with act_bits=", act_bits,
              "; round other blocks in torch before the call");
  TORCH_CHECK(!sub_blocks || act_bits <= 4, op, ": act_block ", act_block, " needs act_bits <= 4 (the sub-block "
              "multipliers times the codes must fit int8); got act_bits=", act_bits, ": use act_block 32 or 0");
  const bool per_token = act_bits != 0 && act_block == 0 && per_token_sums;
  TORCH_CHECK(!per_token || group <= kI8MaxIntGroup, op, ": per-token activations sum a group in int32, which holds "
              "groups of at most ", kI8MaxIntGroup, " features; got ", group,
              ": use a format with smaller groups or act_bits=0");
  const int64_t M = x2.size(0), K = x2.size(1), kb = K / 32, groups = K / group;
  // one allocation: codes, block scales, block sums, group d-sums, group q-sums, half sums
  const int64_t halves = half_sums ? 2 * kb : 0;
  const int64_t bytes = M * K + M * kb * 8 + M * groups * 8 + M * halves * 4;
  TORCH_CHECK(!into.defined() || (into.scalar_type() == at::kChar && into.is_contiguous() && into.numel() >= bytes), op,
              ": the activation storage holds ", into.defined() ? into.numel() : 0, " bytes, this call needs ", bytes);
  ActBuffers out{into.defined() ? into : at::empty({bytes}, x2.options().dtype(at::kChar)), {}};
  int8_t* xq = out.storage.data_ptr<int8_t>();
  float* xd = reinterpret_cast<float*>(xq + M * K);
  int32_t* xs = reinterpret_cast<int32_t*>(xd + M * kb);
  float* dsum = reinterpret_cast<float*>(xs + M * kb);
  int32_t* qsum = reinterpret_cast<int32_t*>(dsum + M * groups);
  out.acts = Q8Acts{xq, xd, xs, M, K, dsum};
  if (M == 0) return out;
  if (act_bits == 0)
    quantize_acts_q8(x2.data_ptr<float>(), M, K, xq, xd, xs);
  else if (sub_blocks)  // each block of 32: one scale, an integer multiplier per sub-block
    quantize_acts_sub_blocks(x2.data_ptr<float>(), M, K, static_cast<int>(act_block), static_cast<int>(act_bits),
                             act_clip, xq, xd, xs);
  else if (act_block)  // each block of 32 a "token" of its own: the per-32 layout with its own scales
    quantize_acts_per_token(x2.data_ptr<float>(), M * kb, kActBlock, static_cast<int>(act_bits), act_clip, xq, xd, xs);
  else  // the same blocks, one scale repeated over the token
    quantize_acts_per_token(x2.data_ptr<float>(), M, K, static_cast<int>(act_bits), act_clip, xq, xd, xs);
  if (with_mins) group_dsums(out.acts, group, dsum);
  if (half_sums) {
    int32_t* hs = qsum + M * groups;
    for (int64_t i = 0; i < M * halves; ++i) {
      int32_t s = 0;
      for (int64_t k = 0; k < 16; ++k) s += xq[i * 16 + k];
      hs[i] = s;
    }
    out.acts.half_sum = hs;
  }
  if (per_token) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        int32_t s = 0;
        for (int64_t b = g * (group / 32); b < (g + 1) * (group / 32); ++b) s += xs[m * kb + b];
        qsum[m * groups + g] = s;
      }
    out.acts.per_token = true;
    out.acts.group_qsum = qsum;
  }
  return out;
}

}  // namespace torch_lowbit
