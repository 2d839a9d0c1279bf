// torch_lowbit::gqa_attention on CPU: softmax(q kᵀ · scale + mask) v for grouped-query attention,
// without repeating the K/V heads: one task per query row, vectorized dot products over D. Inside a
// compiled decode step it is one opaque op: inductor lowers the one-row products of eager attention
// to reduction loops, and MKL's bmm pays ~30 µs of call overhead for these tiny shapes.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/attention_mask.h"
#include "common/decoder_rows.h"
#include "common/parallel.h"

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
  auto qf = q.to(at::kFloat).contiguous();
  auto kf = k.to(at::kFloat).contiguous();
  auto vf = v.to(at::kFloat).contiguous();
  const at::Tensor mf = additive_mask("gqa_attention", mask, B, H, S, L);  // additive fp32 [B, H, S, L] or undefined
  auto out = at::empty({B, S, H, D}, qf.options());
  const float* qp = qf.data_ptr<float>();
  const float* kp = kf.data_ptr<float>();
  const float* vp = vf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const float* mp = mf.defined() ? mf.data_ptr<float>() : nullptr;
  const int64_t ms0 = mp ? mf.stride(0) : 0, ms1 = mp ? mf.stride(1) : 0, ms2 = mp ? mf.stride(2) : 0,
                ms3 = mp ? mf.stride(3) : 0;
  // one task per (b, h, s) query row: scores over L keys, softmax, weighted sum of L value rows
  const AttendRowFn attend = attend_row_kernel();
  parallel_for(0, B * H * S, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> p(L);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (H * S), h = (r / S) % H, s = r % S, kv = h / G;
      const float* qrow = qp + ((b * H + h) * S + s) * D;
      const float* kbase = kp + (b * Hkv + kv) * L * D;
      const float* vbase = vp + (b * Hkv + kv) * L * D;
      const float* mrow = mp ? mp + b * ms0 + h * ms1 + s * ms2 : nullptr;
      attend(qrow, kbase, vbase, D, L, D, fscale, mrow, ms3, p.data(), op + ((b * S + s) * H + h) * D);
    }
  });
  return out.to(q.scalar_type());
}

}  // namespace torch_lowbit
