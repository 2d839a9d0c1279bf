// torch_lowbit::kv_vq_attention on CPU: softmax(q kᵀ · scale + mask) v over a vector-quantized KV cache
// (CQ codes, one byte per channel group; torch_lowbit/formats/kv_vq.py), read through per-query tables
// and a value histogram (common/kv_vq.h); no key or value row is ever rebuilt. Grouped-query heads
// as gqa_attention (query head h reads KV head h / (H / Hkv)); output [B, S, H, D] in q's dtype.
#include <torch/extension.h>

#include <limits>
#include <vector>

#include "common/attention_mask.h"
#include "common/dispatch.h"
#include "common/kv_vq.h"
#include "common/parallel.h"

namespace torch_lowbit {

at::Tensor kv_vq_attention_cpu(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_planes,
                               const at::Tensor& v_codes, const at::Tensor& v_planes,
                               const c10::optional<at::Tensor>& mask, double scale) {
  const char* op = "kv_vq_attention";
  TORCH_CHECK(q.dim() == 4, op, ": q must be [B, heads, S, D]");
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  TORCH_CHECK(k_planes.dim() == 4 && k_planes.scalar_type() == at::kHalf, op,
              ": k_planes must be fp16 codebook planes [Hkv, groups, vec, entries]");
  const int64_t Hkv = k_planes.size(0), G = k_planes.size(1), vec = k_planes.size(2), E = k_planes.size(3);
  TORCH_CHECK(E >= 2 && E <= 256 && G * vec == D && (vec == 2 || vec == 4 || vec == 8), op,
              ": codebooks must cover the head dimension ", D, " in groups of 2, 4 or 8 channels with at most 256 "
              "entries (one byte per code), got ", k_planes.sizes());
  TORCH_CHECK(v_planes.sizes() == k_planes.sizes() && v_planes.scalar_type() == at::kHalf, op,
              ": v_planes must match k_planes");
  TORCH_CHECK(k_codes.dim() == 4 && k_codes.scalar_type() == at::kByte && k_codes.size(0) == B &&
                  k_codes.size(1) == Hkv && k_codes.size(3) == G,
              op, ": k_codes must be uint8 [", B, ", ", Hkv, ", L, ", G, "], got ", k_codes.sizes());
  TORCH_CHECK(v_codes.sizes() == k_codes.sizes() && v_codes.scalar_type() == at::kByte, op, ": v_codes must match k_codes");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, op, ": query heads ", H, " are not a multiple of KV heads ", Hkv);
  const int64_t L = k_codes.size(2), per_kv = H / Hkv;
  auto qf = q.to(at::kFloat).contiguous();
  auto kc = k_codes.contiguous(), vc = v_codes.contiguous(), kb = k_planes.contiguous(), vb = v_planes.contiguous();
  const at::Tensor mf = additive_mask("kv_vq_attention", mask, B, H, S, L);  // additive fp32 [B, H, S, L] or undefined
  auto out = at::empty({B, S, H, D}, qf.options());
  auto task_fn = kv_vq_task_scalar;
#if defined(TORCH_LOWBIT_X86)
  if (kernel_isa(active_cpu_path()) != CpuPath::Scalar && E % 8 == 0) task_fn = kv_vq_task_avx2;
#endif
  parallel_for(0, B * H * S, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch(kv_vq_scratch_floats(L, G, E));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * S), h = (i / S) % H, s = i % S, kv = h / per_kv;
      KvVqTask t;
      t.q = qf.data_ptr<float>() + ((b * H + h) * S + s) * D;
      t.k_codes = kc.data_ptr<uint8_t>() + (b * Hkv + kv) * L * G;
      t.v_codes = vc.data_ptr<uint8_t>() + (b * Hkv + kv) * L * G;
      t.k_planes = kb.data_ptr<c10::Half>() + kv * G * vec * E;
      t.v_planes = vb.data_ptr<c10::Half>() + kv * G * vec * E;
      t.mask = mf.defined() ? mf.data_ptr<float>() + b * mf.stride(0) + h * mf.stride(1) + s * mf.stride(2) : nullptr;
      t.mask_key_stride = mf.defined() ? mf.stride(3) : 0;
      t.out = out.data_ptr<float>() + ((b * S + s) * H + h) * D;
      t.L = L;
      t.D = D;
      t.vec = vec;
      t.E = E;
      t.groups = G;
      t.scale = static_cast<float>(scale);
      t.scratch = scratch.data();
      task_fn(t);
    }
  });
  return out.to(q.scalar_type());
}

}  // namespace torch_lowbit
