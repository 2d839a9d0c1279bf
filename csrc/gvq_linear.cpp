// torch_lowbit::gvq_linear / gvq_dequantize on CPU: the general VQ formats in the gvq_rowmajor layout
// (gvq.h). Activations arrive rotated where the format rotates (done by the caller) and stay fp32.
// Up to kGvqFusedMaxTokens tokens the table GEMV runs, the threads splitting the chunks of fields
// (each builds only its own chunks' tables) into partial sums that are then reduced; beyond it row
// chunks are decoded to fp32 and multiplied with at::mm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "common/decode_matmul.h"
#include "common/dispatch.h"
#include "common/gvq.h"
#include "common/linear_io.h"
#include "common/parallel.h"

namespace torch_lowbit {

namespace {
std::atomic<int> g_variant{0};
}  // namespace

GvqVariant gvq_kernel_variant() { return static_cast<GvqVariant>(g_variant.load(std::memory_order_relaxed)); }

void set_gvq_kernel_variant(const std::string& name) {
  const int v = name == "tables" ? 0 : name == "direct" ? 1 : name == "decode" ? 2 : -1;
  TORCH_CHECK(v >= 0, "gvq kernel variant must be tables, direct or decode, got ", name);
  g_variant.store(v, std::memory_order_relaxed);
}

namespace {

GvqDirectFn gvq_direct(CpuPath p) {
#if defined(TORCH_LOWBIT_X86)
  if (p == CpuPath::Avx512) return gvq_direct_avx512;
  if (p != CpuPath::Scalar) return gvq_direct_avx2;
#endif
  (void)p;
  return gvq_direct_scalar;
}

// The direct kernel's inputs: fp32 entries [regions, stages, E, vec] and where each field's start.
at::Tensor direct_entries(const at::Tensor& planes) { return planes.transpose(2, 3).to(at::kFloat).contiguous(); }

std::vector<int32_t> field_bases(const GvqWeights& w) {
  std::vector<int32_t> base(w.row_tiles() * w.fields);
  for (int64_t rt = 0; rt < w.row_tiles(); ++rt)
    for (int64_t f = 0; f < w.fields; ++f)
      base[rt * w.fields + f] = static_cast<int32_t>((w.region(rt, f) * w.stages + f % w.stages) * w.entries * w.vec);
  return base;
}

GvqGemvFn gvq_gemv(CpuPath p) {
#if defined(TORCH_LOWBIT_X86)
  if (p == CpuPath::Avx512) return gvq_gemv_avx512;
  if (p != CpuPath::Scalar) return gvq_gemv_avx2;  // avx2, avxvnni
#endif
  (void)p;
  return gvq_gemv_scalar;
}

GvqWeights gvq_weights(const char* op, const at::Tensor& codes, int64_t code_bits, const at::Tensor& planes,
                       int64_t tile_rows, int64_t tile_cols, const at::Tensor& row_scales, int64_t K) {
  TORCH_CHECK(code_bits >= 4 && code_bits <= 16, op, ": code_bits must be 4..16, got ", code_bits);
  const int64_t entries = int64_t{1} << code_bits;
  TORCH_CHECK(planes.scalar_type() == at::kHalf && planes.dim() == 4 && (planes.size(1) == 1 || planes.size(1) == 2) &&
                  (planes.size(2) == 2 || planes.size(2) == 4 || planes.size(2) == 8) && planes.size(3) == entries,
              op, ": codebooks must be fp16 planes [regions, 1 or 2 stages, vec 2/4/8, ", entries, "], got ",
              planes.scalar_type(), " ", planes.sizes());
  const int64_t vec = planes.size(2), stages = planes.size(1);
  TORCH_CHECK(K > 0 && K % vec == 0, op, ": in_features ", K, " must be a multiple of the vector size ", vec);
  TORCH_CHECK(tile_rows >= 0 && tile_cols >= 0 && tile_cols % vec == 0, op,
              ": tile_rows / tile_cols must be >= 0, tile_cols a multiple of ", vec);
  TORCH_CHECK(row_scales.scalar_type() == at::kHalf && row_scales.dim() == 1, op, ": row_scales must be fp16 [N]");
  const int64_t N = row_scales.size(0), fields = K / vec * stages;
  const int64_t row_bytes = (fields * code_bits + 7) / 8;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.size(0) == N && codes.size(1) == row_bytes,
              op, ": codes must be uint8 [", N, ", ", row_bytes, "] for in_features ", K, " (x's last dimension), got ",
              codes.scalar_type(), " ", codes.sizes());
  const int64_t row_tiles = tile_rows ? (N + tile_rows - 1) / tile_rows : 1;
  const int64_t col_tiles = tile_cols ? (K + tile_cols - 1) / tile_cols : 1;
  TORCH_CHECK(planes.size(0) == row_tiles * col_tiles, op, ": ", row_tiles * col_tiles,
              " codebook regions expected for a ", N, "x", K, " weight with tiles ", tile_rows, "x", tile_cols,
              ", got ", planes.size(0));
  TORCH_CHECK(codes.device().is_cpu() && planes.device().is_cpu() && row_scales.device().is_cpu(), op,
              " (CPU kernel): all tensors must be on the CPU");
  const int64_t chunk_fields = gvq_chunk_fields(entries);
  return {codes.data_ptr<uint8_t>(), static_cast<int>(code_bits), static_cast<int>(vec), static_cast<int>(stages),
          entries, planes.data_ptr<c10::Half>(), tile_rows, tile_cols, col_tiles, row_scales.data_ptr<c10::Half>(),
          N, K, fields, chunk_fields, (fields + chunk_fields - 1) / chunk_fields};
}

}  // namespace

at::Tensor gvq_linear_cpu(const at::Tensor& x, const at::Tensor& codes, int64_t code_bits, const at::Tensor& planes,
                          int64_t tile_rows, int64_t tile_cols, const at::Tensor& row_scales,
                          const c10::optional<at::Tensor>& bias) {
  const char* op = "gvq_linear";
  const int64_t K = x.size(-1);
  const at::Tensor cc = codes.contiguous(), pc = planes.contiguous(), sc = row_scales.contiguous();
  const GvqWeights w = gvq_weights(op, cc, code_bits, pc, tile_rows, tile_cols, sc, K);
  check_linear_io(op, x, K, w.N, 0, bias, {});
  const at::Tensor x2 = activations_fp32(x, K);
  const int64_t M = x2.size(0);
  const GvqVariant variant = gvq_kernel_variant();
  if (M > kGvqFusedMaxTokens || variant == GvqVariant::Decode) {
    at::Tensor out = decode_matmul(x2, w.N, K, 1, [&](int64_t n0, int64_t n1, float* dst) { gvq_decode_scalar(w, n0, n1, dst); });
    return finish_linear(out, x, bias);
  }
  if (variant == GvqVariant::Direct) {
    TORCH_CHECK(w.regions() * w.stages * w.entries * w.vec < (int64_t{1} << 31), op, ": codebooks too large for the direct kernel");
    const at::Tensor entries = direct_entries(pc);
    const std::vector<int32_t> base = field_bases(w);
    at::Tensor out = at::zeros({M, w.N}, x2.options());
    const GvqDirectFn direct = gvq_direct(active_cpu_path());
    if (M > 0)
      parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
        direct(w, entries.data_ptr<float>(), base.data(), x2.data_ptr<float>(), M, n0, n1, out.data_ptr<float>());
      });
    return finish_linear(out.mul_(sc.to(at::kFloat)), x, bias);
  }
  // codebook-centric split: each range of chunks builds its own tables and sums into its own partials
  const int64_t threads = std::max<int64_t>(1, pool_threads() ? pool_threads() : at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, w.chunks / (2 * threads));
  const int64_t parts = (w.chunks + grain - 1) / grain;
  at::Tensor partial = at::zeros({std::max<int64_t>(parts, 1), M, w.N}, x2.options());
  const GvqGemvFn gemv = gvq_gemv(active_cpu_path());
  if (M > 0)
    parallel_for(0, w.chunks, grain, [&](int64_t c0, int64_t c1) {
      gemv(w, x2.data_ptr<float>(), M, c0, c1, partial.data_ptr<float>() + (c0 / grain) * M * w.N);
    });
  at::Tensor out = partial.sum(0).mul_(sc.to(at::kFloat));
  return finish_linear(out, x, bias);
}

at::Tensor gvq_dequantize_cpu(const at::Tensor& codes, int64_t code_bits, const at::Tensor& planes, int64_t tile_rows,
                              int64_t tile_cols, const at::Tensor& row_scales, int64_t in_features) {
  const at::Tensor cc = codes.contiguous(), pc = planes.contiguous(), sc = row_scales.contiguous();
  const GvqWeights w = gvq_weights("gvq_dequantize", cc, code_bits, pc, tile_rows, tile_cols, sc, in_features);
  at::Tensor out = at::empty({w.N, in_features}, planes.options().dtype(at::kFloat));
  parallel_for(0, w.N, 8, [&](int64_t n0, int64_t n1) { gvq_decode_scalar(w, n0, n1, out.data_ptr<float>() + n0 * in_features); });
  return out;
}

}  // namespace torch_lowbit
