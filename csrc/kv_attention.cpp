// torch_lowbit::kv_attention on CPU: softmax(q kᵀ · scale + mask) v with k and v read from a
// group-wise quantized KV cache (codes + fp16 scale / min per group; torch_lowbit/formats/kv.py),
// dequantized row by row in registers: the cache is streamed at 0.56 bytes per value (4-bit,
// group 64) instead of 4. Grouped-query heads as gqa_attention (query head h reads KV head
// h / (H / Hkv)); output [B, S, H, D] in q's dtype. One task per (batch, KV head, block of query rows).
// Optionally the most recent tokens come exact from fp32 rings (KIVI: QuantizedKVLayer's residual).
#include <torch/extension.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "common/attention_mask.h"
#include "common/dispatch.h"
#include "common/kv_attention.h"
#include "common/parallel.h"

namespace torch_lowbit {

at::Tensor kv_attention_cpu(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                            const at::Tensor& k_min, const at::Tensor& v_codes, const at::Tensor& v_scale,
                            const at::Tensor& v_min, const c10::optional<at::Tensor>& mask, double scale,
                            int64_t bits, const c10::optional<at::Tensor>& k_recent,
                            const c10::optional<at::Tensor>& v_recent, const c10::optional<at::Tensor>& recent_end) {
  TORCH_CHECK(bits == 4 || bits == 8, "kv_attention: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(q.dim() == 4, "kv_attention: q must be [B, heads, S, D]");
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.scalar_type() == at::kByte,
              "kv_attention: k_codes must be uint8 [B, Hkv, L, D * bits / 8]");
  const int64_t Hkv = k_codes.size(1), L = k_codes.size(2);
  TORCH_CHECK(k_codes.size(0) == B && k_codes.size(3) * 8 == D * bits, "kv_attention: k_codes must be [", B,
              ", Hkv, L, ", D * bits / 8, "], got ", k_codes.sizes());
  TORCH_CHECK(k_scale.dim() == 4 && k_scale.size(3) > 0 && D % k_scale.size(3) == 0,
              "kv_attention: scales must be [B, Hkv, L, D / group]");
  const int64_t group = D / k_scale.size(3);
  for (const at::Tensor* t : {&k_scale, &k_min, &v_scale, &v_min})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->sizes() == k_scale.sizes(),
                "kv_attention: scales and mins must be fp16 of one shape [B, Hkv, L, D / group]");
  TORCH_CHECK(v_codes.sizes() == k_codes.sizes() && v_codes.scalar_type() == at::kByte,
              "kv_attention: v_codes must match k_codes");
  TORCH_CHECK(k_scale.size(0) == B && k_scale.size(1) == Hkv && k_scale.size(2) == L,
              "kv_attention: scales must be [B, Hkv, L, D / group]");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "kv_attention: query heads ", H, " are not a multiple of KV heads ", Hkv);
  const int64_t G = H / Hkv;
  TORCH_CHECK(G <= kKvMaxQueries, "kv_attention: at most ", kKvMaxQueries, " query heads per KV head, got ", G);
  TORCH_CHECK(group % 2 == 0, "kv_attention: the group must be even, got ", group);
  auto qf = q.to(at::kFloat).contiguous();
  auto kc = k_codes.contiguous(), vc = v_codes.contiguous();
  auto ks = k_scale.contiguous(), km = k_min.contiguous(), vs = v_scale.contiguous(), vm = v_min.contiguous();
  const at::Tensor mf = additive_mask("kv_attention", mask, B, H, S, L);  // additive fp32 [B, H, S, L] or undefined
  // exact recent tokens: rings [B, Hkv, R, D] holding positions [end - R, end) at slot position % R
  at::Tensor kr, vr;
  int64_t R = 0, recent_lo = 0, recent_hi = 0;
  if (k_recent.has_value()) {
    TORCH_CHECK(v_recent.has_value() && recent_end.has_value(), "kv_attention: k_recent needs v_recent and recent_end");
    R = k_recent->size(2);
    TORCH_CHECK(k_recent->dim() == 4 && k_recent->size(0) == B && k_recent->size(1) == Hkv && k_recent->size(3) == D &&
                    v_recent->sizes() == k_recent->sizes() && R > 0,
                "kv_attention: k_recent / v_recent must be [B, Hkv, R, D] rings");
    TORCH_CHECK(recent_end->numel() == 1, "kv_attention: recent_end must hold one position");
    kr = k_recent->to(at::kFloat).contiguous();
    vr = v_recent->to(at::kFloat).contiguous();
    recent_hi = std::min<int64_t>(recent_end->item<int64_t>(), L);
    recent_lo = std::max<int64_t>(recent_hi - R, 0);
  }
  auto out = at::empty({B, S, H, D}, qf.options());
  auto task_fn = kv_attention_task_scalar;
#if defined(TORCH_LOWBIT_X86)
  if (kernel_isa(active_cpu_path()) != CpuPath::Scalar && group % 8 == 0) task_fn = kv_attention_task_avx2;
#endif
#if defined(__aarch64__)
  if (active_cpu_path() != CpuPath::Scalar && group % 8 == 0) task_fn = kv_attention_task_neon;  // neon, dotprod, i8mm
#endif
  const int64_t row_bytes = D * bits / 8, groups = D / group;
  const auto* kcp = kc.data_ptr<uint8_t>();
  const auto* vcp = vc.data_ptr<uint8_t>();
  const auto* ksp = reinterpret_cast<const uint16_t*>(ks.data_ptr<at::Half>());
  const auto* kmp = reinterpret_cast<const uint16_t*>(km.data_ptr<at::Half>());
  const auto* vsp = reinterpret_cast<const uint16_t*>(vs.data_ptr<at::Half>());
  const auto* vmp = reinterpret_cast<const uint16_t*>(vm.data_ptr<at::Half>());
  // Tasks of `rows` query positions: each rebuilt key / value row serves rows * G queries. Blocks
  // are as tall as the softmax state allows, but cut shorter while there are fewer than ~4 tasks per
  // thread (a prefill of few KV heads).
  const int64_t max_rows = std::max<int64_t>(1, kKvMaxQueries / G);
  const int64_t want_tasks = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t blocks = std::min(S, std::max((S + max_rows - 1) / max_rows, (want_tasks + B * Hkv - 1) / (B * Hkv)));
  const int64_t rows = (S + blocks - 1) / blocks;
  const int64_t row_blocks = (S + rows - 1) / rows;
  parallel_for(0, B * Hkv * row_blocks, 1, [&](int64_t r0, int64_t r1) {
    const int64_t scratch_floats = kv_attention_scratch_floats(rows * G, L, D);
    std::vector<float> scratch(scratch_floats);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (Hkv * row_blocks), kv = (r / row_blocks) % Hkv, s = (r % row_blocks) * rows;
      const int64_t cache_row = (b * Hkv + kv) * L;
      KvAttentionTask t;
      t.q = qf.data_ptr<float>() + ((b * H + kv * G) * S + s) * D;
      t.q_stride = S * D;
      t.rows = std::min(rows, S - s);
      t.q_row_stride = D;
      t.out_row_stride = H * D;
      t.mask_row_stride = mf.defined() ? mf.stride(2) : 0;
      t.k_codes = kcp + cache_row * row_bytes;
      t.v_codes = vcp + cache_row * row_bytes;
      t.k_scale = ksp + cache_row * groups;
      t.k_min = kmp + cache_row * groups;
      t.v_scale = vsp + cache_row * groups;
      t.v_min = vmp + cache_row * groups;
      t.mask = mf.defined() ? mf.data_ptr<float>() + b * mf.stride(0) + kv * G * mf.stride(1) + s * mf.stride(2)
                            : nullptr;
      t.mask_head_stride = mf.defined() ? mf.stride(1) : 0;
      t.mask_key_stride = mf.defined() ? mf.stride(3) : 0;
      t.out = out.data_ptr<float>() + ((b * S + s) * H + kv * G) * D;
      t.out_stride = D;
      t.G = G;
      t.L = L;
      t.D = D;
      t.group = group;
      t.bits = static_cast<int>(bits);
      t.scale = static_cast<float>(scale);
      t.scores = scratch.data();
      t.row = scratch.data() + scratch_floats - kKvScratchRows * D;
      if (R) {
        t.k_recent = kr.data_ptr<float>() + (b * Hkv + kv) * R * D;
        t.v_recent = vr.data_ptr<float>() + (b * Hkv + kv) * R * D;
        t.recent_len = R;
        t.recent_lo = recent_lo;
        t.recent_hi = recent_hi;
      }
      task_fn(t);
    }
  });
  return out.to(q.scalar_type());
}

}  // namespace torch_lowbit
