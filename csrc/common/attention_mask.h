// The attention ops' mask argument (gqa_attention, kv_attention, kv_vq_attention): None, bool (true =
// attend) or additive, broadcastable to [B, H, S, L], as an additive fp32 view of that shape (broadcast
// dimensions keep stride 0), or an undefined tensor for None.
#pragma once
#include <ATen/ATen.h>

#include <limits>

namespace torch_lowbit {

inline at::Tensor additive_mask(const char* op, const c10::optional<at::Tensor>& mask, int64_t B, int64_t H, int64_t S,
                                int64_t L) {
  if (!mask.has_value()) return at::Tensor();
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.dim() == 4, op, ": mask must be 4-D, broadcastable to [B, heads, S, L]");
  return (m.scalar_type() == at::kBool ? at::where(m, 0.0f, -std::numeric_limits<float>::infinity())
                                       : m.to(at::kFloat))
      .expand({B, H, S, L});
}

}  // namespace torch_lowbit
