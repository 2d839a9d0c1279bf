// torch_lowbit::hadamard_transform on CPU: validation, the base-matrix registry, dtype conversion,
// path choice and threading. Kernels: common/hadamard.h.
//
// Convention (torch_lowbit/rotations/hadamard.py): H_n = (H_k ⊗ H_{2^m}) / sqrt(n),
//   forward  y = (x * signs) @ H_n,     inverse  y = (x @ H_n^T) * signs.
// For the block mix, forward uses H_k^T and inverse H_k (out block c = sum_a mix[c, a] * block a).
//
// The base matrices H_k live in one table, in Python (torch_lowbit/rotations/_base_matrices.py);
// torch_lowbit.rotations registers each one here at import through _C.register_hadamard_base, which
// checks it is a Hadamard matrix before accepting it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <vector>

#include "common/dispatch.h"
#include "common/hadamard.h"
#include "common/parallel.h"

namespace torch_lowbit {
namespace {

struct BaseHadamard {
  int64_t k;
  std::vector<float> h;   // row-major H_k: the inverse transform's block mix
  std::vector<float> ht;  // H_k^T: the forward transform's block mix
};

std::mutex registry_mutex;
std::map<int64_t, std::shared_ptr<const BaseHadamard>>& registry() {
  static std::map<int64_t, std::shared_ptr<const BaseHadamard>> bases;
  return bases;
}

bool is_power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

}  // namespace

// Bound as _C.register_hadamard_base (csrc/ops.cpp): registry setup, not an op.
void register_hadamard_base(const at::Tensor& base) {
  TORCH_CHECK(base.dim() == 2 && base.size(0) == base.size(1),
              "register_hadamard_base: base must be a square matrix, got shape ", base.sizes());
  const int64_t k = base.size(0);
  TORCH_CHECK(k >= 4 && k % 4 == 0, "register_hadamard_base: order ", k,
              " is not a multiple of 4 (every Hadamard order above 2 is)");
  const at::Tensor h64 = base.to(at::kDouble).contiguous();
  TORCH_CHECK(at::all(at::abs(h64) == 1).item<bool>(), "register_hadamard_base: entries must be +-1");
  TORCH_CHECK(at::equal(at::mm(h64, h64.t()), at::eye(k, h64.options()) * static_cast<double>(k)),
              "register_hadamard_base: H H^T != k I for k = ", k);
  auto entry = std::make_shared<BaseHadamard>();
  entry->k = k;
  const at::Tensor h32 = h64.to(at::kFloat), ht32 = h32.t().contiguous();
  entry->h.assign(h32.data_ptr<float>(), h32.data_ptr<float>() + k * k);
  entry->ht.assign(ht32.data_ptr<float>(), ht32.data_ptr<float>() + k * k);
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[k] = std::move(entry);
}

namespace {

// The registered base for n (largest k with n / k a power of two, as in Python's base_order);
// nullptr when n is a power of two with no larger fitting base.
std::shared_ptr<const BaseHadamard> base_for(int64_t n) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto& bases = registry();
  for (auto it = bases.rbegin(); it != bases.rend(); ++it)
    if (n % it->first == 0 && is_power_of_two(n / it->first)) return it->second;
  TORCH_CHECK(is_power_of_two(n), "hadamard_transform: last dimension ", n,
              " is not k * 2^m for k = 1 or a registered base order (",
              [&] {
                std::ostringstream s;
                for (const auto& kv : bases) s << kv.first << " ";
                return bases.empty() ? std::string("none registered: import torch_lowbit.rotations")
                                     : s.str();
              }(),
              ")");
  return nullptr;
}

struct Kernels {
  FwhtFn fwht;
  BlockMixFn mix;
};

Kernels kernels_for(CpuPath p) {
#if defined(__aarch64__)
  if (p != CpuPath::Scalar) return {fwht_neon, block_mix_neon};  // neon, dotprod, i8mm
#endif
  switch (kernel_isa(p)) {
#if defined(TORCH_LOWBIT_X86)
    case CpuPath::Avx512: return {fwht_avx512, block_mix_avx512};
    case CpuPath::Avx2: return {fwht_avx2, block_mix_avx2};
#endif
    default: return {fwht_scalar, block_mix_scalar};
  }
}

template <typename scalar_t>
void transform_rows(const scalar_t* x, scalar_t* y, int64_t rows, int64_t n, const BaseHadamard* base,
                    bool inverse, const float* pre, const float* post) {
  const int64_t k = base ? base->k : 1, len = n / k;
  const float* mix = base ? (inverse ? base->h.data() : base->ht.data()) : nullptr;
  const Kernels kern = kernels_for(active_cpu_path());
  // Enough rows per task that a task is worth starting (~16K values).
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / n);
  parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n), mixed(mix ? n : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const scalar_t* src = x + r * n;
      if (pre) {
        for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]) * pre[i];
      } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
      }
      kern.fwht(buf.data(), k, len);
      const float* result = buf.data();
      if (mix) {
        kern.mix(mix, k, buf.data(), mixed.data(), len);
        result = mixed.data();
      }
      scalar_t* dst = y + r * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(result[i] * post[i]);
    }
  });
}

}  // namespace

at::Tensor hadamard_transform_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& signs, bool inverse) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "hadamard_transform: x must be fp32, bf16 or fp16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "hadamard_transform: x must have at least one dimension");
  const int64_t n = x.size(-1);
  TORCH_CHECK(n > 0, "hadamard_transform: the last dimension must not be empty");
  if (signs.has_value()) {
    TORCH_CHECK(signs->dim() == 1 && signs->size(0) == n, "hadamard_transform: signs must be a 1-D tensor of ",
                n, " values (the last dimension of x), got shape ", signs->sizes());
    TORCH_CHECK(signs->scalar_type() == at::kFloat, "hadamard_transform: signs must be fp32, got ",
                signs->scalar_type());
    TORCH_CHECK(signs->device() == x.device(), "hadamard_transform: signs are on ", signs->device(),
                ", x on ", x.device());
  }
  const std::shared_ptr<const BaseHadamard> base = base_for(n);

  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = xc.numel() / n;
  if (rows == 0) return y;

  // Forward: signs before the transform; inverse: after. 1/sqrt(n) folds into the output factor.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  const at::Tensor s = signs.has_value() ? signs->contiguous() : at::Tensor();
  std::vector<float> post(n, scale);
  if (signs.has_value() && inverse)
    for (int64_t i = 0; i < n; ++i) post[i] *= s.data_ptr<float>()[i];
  const float* pre = signs.has_value() && !inverse ? s.data_ptr<float>() : nullptr;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "hadamard_transform", [&] {
    transform_rows<scalar_t>(xc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, n, base.get(), inverse, pre,
                             post.data());
  });
  return y;
}

}  // namespace torch_lowbit

TORCH_LIBRARY_IMPL(torch_lowbit, CPU, m) {
  m.impl("hadamard_transform", &torch_lowbit::hadamard_transform_cpu);
}
