// torch_lowbit::gqa_attention on CPU: softmax(q kᵀ · scale + mask) v for grouped-query attention,
// without repeating the K/V heads. Built from ATen calls on purpose: inside a compiled decode step it
// is one opaque op, so inductor keeps MKL's batched matmuls instead of decomposing the one-row
// products into scalar reduction loops (which cost ~4x more on SmolLM2's 30 layers).
#include <torch/extension.h>

#include <limits>

namespace torch_lowbit {

// q [B, H, S, D]; k, v [B, Hkv, L, D] with H % Hkv == 0 (query head h reads KV head h / (H / Hkv), as
// transformers' repeat_kv); mask: None, bool (true = attend) or additive, broadcastable to
// [B, 1 or H, S, L]. Returns [B, S, H, D] (the layout attention modules project from), in q's dtype.
at::Tensor gqa_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "gqa_attention: q, k, v must be 4-D [B, heads, seq, D]");
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == L && k.size(3) == D &&
                  v.size(3) == D,
              "gqa_attention: k and v must be [B, Hkv, L, D] matching q [B, H, S, D]");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "gqa_attention: query heads ", H, " are not a multiple of KV heads ", Hkv);
  const int64_t G = H / Hkv;
  auto qf = q.to(at::kFloat).contiguous().view({B * Hkv, G * S, D});
  auto kf = k.to(at::kFloat).contiguous().view({B * Hkv, L, D});
  auto vf = v.to(at::kFloat).contiguous().view({B * Hkv, L, D});
  auto scores = at::bmm(qf, kf.transpose(1, 2)).mul_(scale);  // [B*Hkv, G*S, L]
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.dim() == 4, "gqa_attention: mask must be 4-D, broadcastable to [B, heads, S, L]");
    auto s5 = scores.view({B, Hkv, G, S, L});
    auto m5 = m.expand({B, H, S, L}).reshape({B, Hkv, G, S, L});
    if (m.scalar_type() == at::kBool) {
      s5.masked_fill_(m5.logical_not(), -std::numeric_limits<float>::infinity());
    } else {
      s5.add_(m5.to(at::kFloat));
    }
  }
  auto probs = at::softmax(scores, -1);
  auto out = at::bmm(probs, vf);  // [B*Hkv, G*S, D]
  return out.view({B, H, S, D}).transpose(1, 2).contiguous().to(q.scalar_type());
}

}  // namespace torch_lowbit
