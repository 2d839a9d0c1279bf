// torch_lowbit::codebook_linear / tcq_linear (and their dequantize ops) on CPU: the Q-Palette
// formats in the palette_packed layout (palette.h). Activations arrive rotated (x' = (x * s) @ H,
// done by the caller) and stay fp32: the codebooks are not integer grids, so there is no int8 path.
// Up to kPaletteFusedMaxTokens tokens the fused kernels run, threaded over rows (16-row bands for
// TCQ); beyond it row chunks are decoded to fp32 and multiplied with at::mm.
#include <ATen/ATen.h>

#include <algorithm>

#include "common/decode_matmul.h"
#include "common/dispatch.h"
#include "common/linear_io.h"
#include "common/palette.h"
#include "common/parallel.h"
#include "common/scratch.h"

namespace torch_lowbit {
namespace {

struct CodebookKernels {
  CodebookGemvFn gemv;
  CodebookDecodeFn decode;
};
struct TcqKernels {
  TcqGemvFn gemv;
  TcqDecodeFn decode;
};

CodebookKernels codebook_kernels(CpuPath p) {
#if defined(TORCH_LOWBIT_X86)
  if (p == CpuPath::Avx512 && cpu_has_avx512_vbmi()) return {codebook_gemv_avx512, codebook_decode_avx512};
  if (p != CpuPath::Scalar) return {codebook_gemv_avx2, codebook_decode_avx2};  // avx2, avxvnni, AVX-512 w/o VBMI
#endif
#if defined(__aarch64__)
  if (p != CpuPath::Scalar) return {codebook_gemv_neon, codebook_decode_neon};  // neon, dotprod, i8mm
#endif
  (void)p;
  return {codebook_gemv_scalar, codebook_decode_scalar};
}

TcqKernels tcq_kernels(CpuPath p) {
#if defined(TORCH_LOWBIT_X86)
  // The GEMV is the 256-bit one on every x86 path, with vpdpbusd byte sums where the CPU has them: on
  // Zen 4 it ran 1.2-1.4x faster than the former 512-bit GEMV (docs/kernels/cpu.md, "TCQ on Zen 4").
  const TcqGemvFn gemv = !cpu_has_vnni_ymm() || p == CpuPath::Avx2 ? tcq_gemv_avx2
                         : cpu_has_avx_vnni()                    ? tcq_gemv_avxvnni
                                                                 : tcq_gemv_avxvnni_evex;
  if (p == CpuPath::Avx512 && cpu_has_avx512_vbmi()) return {gemv, tcq_decode_avx512};
  if (p != CpuPath::Scalar) return {gemv, tcq_decode_avx2};
#endif
#if defined(__aarch64__)
  if (p != CpuPath::Scalar) return {tcq_gemv_neon, tcq_decode_neon};  // neon, dotprod, i8mm
#endif
  (void)p;
  return {tcq_gemv_scalar, tcq_decode_scalar};
}

void check_row_scales(const char* op, const at::Tensor& row_scales, int64_t N) {
  TORCH_CHECK(row_scales.scalar_type() == at::kHalf && row_scales.dim() == 1 && row_scales.size(0) == N, op,
              ": row_scales must be fp16 [", N, "], got ", row_scales.scalar_type(), " ", row_scales.sizes());
  TORCH_CHECK(row_scales.device().is_cpu(), op, " (CPU kernel): all tensors must be on the CPU");
}

// CodebookWeights over checked tensors; `planes` keeps the [d, 2^b] table alive.
CodebookWeights codebook_weights(const char* op, const at::Tensor& codes, int64_t code_bits, const at::Tensor& table,
                                 const at::Tensor& row_scales, int64_t K, at::Tensor& planes) {
  TORCH_CHECK(code_bits >= 1 && code_bits <= 12, op, ": code_bits must be 1..12, got ", code_bits);
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 2 && table.size(0) == (int64_t{1} << code_bits) &&
                  (table.size(1) == 1 || table.size(1) == 2),
              op, ": table must be fp32 [2^code_bits, 1 or 2], got ", table.scalar_type(), " ", table.sizes());
  const int64_t dim = table.size(1);
  TORCH_CHECK(K > 0 && K % dim == 0, op, ": in_features ", K, " must be a multiple of ", dim, " (weights per code)");
  const int64_t per_stream = (K / dim + kCodeStreams - 1) / kCodeStreams;  // codes per stream
  const int64_t row_words = kCodeStreams * ((per_stream * code_bits + 31) / 32);
  TORCH_CHECK(codes.scalar_type() == at::kInt && codes.dim() == 2 && codes.size(1) == row_words, op,
              ": codes must be int32 [N, ", row_words, "] (", K / dim, " ", code_bits,
              "-bit codes per row in 16 streams), got ", codes.scalar_type(), " ", codes.sizes());
  TORCH_CHECK(codes.device().is_cpu() && table.device().is_cpu(), op, " (CPU kernel): all tensors must be on the CPU");
  check_row_scales(op, row_scales, codes.size(0));
  planes = table.t().contiguous();
  return {reinterpret_cast<const uint32_t*>(codes.data_ptr<int32_t>()), row_words, static_cast<int>(code_bits),
          static_cast<int>(dim), planes.data_ptr<float>(), row_scales.data_ptr<c10::Half>(), nullptr,
          codes.size(0), K};
}

TcqWeights tcq_weights(const char* op, const at::Tensor& codes, const at::Tensor& table, int64_t table_bits,
                       int64_t shift_bits, const at::Tensor& row_scales) {
  TORCH_CHECK(shift_bits >= 3 && shift_bits <= 10, op, ": shift_bits must be 3..10 (tcq1.5 .. tcq5), got ", shift_bits);
  TORCH_CHECK(table_bits >= 0 && table_bits <= 15, op, ": table_bits must be 0..15, got ", table_bits);
  const int64_t entries = table_bits == kTcqMadTableBits ? 0 : int64_t{2} << table_bits;
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.dim() == 2 &&
                  table.size(0) == entries && table.size(1) == 2,
              op, ": table must be the contiguous fp32 signed table [2^(table_bits+1), 2] (tcq_kernel_table; "
              "table_bits 0: the 1mad code, an empty [0, 2] table), got ", table.scalar_type(), " ", table.sizes());
  TORCH_CHECK(codes.scalar_type() == at::kInt && codes.dim() == 3 && codes.size(2) == 4 * shift_bits, op,
              ": codes must be int32 [N/16, K/16, ", 4 * shift_bits, "], got ", codes.scalar_type(), " ", codes.sizes());
  TORCH_CHECK(codes.device().is_cpu() && table.device().is_cpu(), op, " (CPU kernel): all tensors must be on the CPU");
  const int64_t N = codes.size(0) * kTcqTile, K = codes.size(1) * kTcqTile;
  check_row_scales(op, row_scales, N);
  return {reinterpret_cast<const uint32_t*>(codes.data_ptr<int32_t>()), static_cast<int>(shift_bits),
          static_cast<int>(table_bits), table.data_ptr<float>(), row_scales.data_ptr<c10::Half>(), nullptr, N, K};
}

}  // namespace

at::Tensor codebook_linear_cpu(const at::Tensor& x, const at::Tensor& codes, int64_t code_bits, const at::Tensor& table,
                               const at::Tensor& row_scales, const c10::optional<at::Tensor>& bias) {
  const char* op = "codebook_linear";
  const int64_t K = x.size(-1);
  at::Tensor planes;
  const at::Tensor cc = codes.contiguous(), sc = row_scales.contiguous();
  CodebookWeights w = codebook_weights(op, cc, code_bits, table, sc, K, planes);
  check_linear_io(op, x, K, w.N, 0, bias, {});
  const at::Tensor x2 = activations_fp32(x, K);
  const int64_t M = x2.size(0);
  const CodebookKernels kern = codebook_kernels(active_cpu_path());
  if (M > kPaletteFusedMaxTokens) {
    at::Tensor out = decode_matmul(x2, w.N, K, 1, [&](int64_t n0, int64_t n1, float* dst) { kern.decode(w, n0, n1, dst); });
    return finish_linear(out, x, bias);
  }
  const at::Tensor b32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  w.bias = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  // d planes of x': acts[c][m][j] = x'[m, d j + c]
  const at::Tensor acts = x2.view({M, K / w.dim, w.dim}).permute({2, 0, 1}).contiguous();
  at::Tensor out = at::empty({M, w.N}, x2.options());
  if (M > 0) {
    const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 16) / K);
    parallel_for(0, w.N, grain, [&](int64_t n0, int64_t n1) {
      kern.gemv(w, acts.data_ptr<float>(), M, n0, n1, out.data_ptr<float>());
    });
  }
  return finish_linear(out, x, bias, /*bias_fused=*/true);
}

at::Tensor codebook_dequantize_cpu(const at::Tensor& codes, int64_t code_bits, const at::Tensor& table,
                                   const at::Tensor& row_scales, int64_t in_features) {
  at::Tensor planes;
  const at::Tensor cc = codes.contiguous(), sc = row_scales.contiguous();
  const CodebookWeights w = codebook_weights("codebook_dequantize", cc, code_bits, table, sc, in_features, planes);
  at::Tensor out = at::empty({w.N, in_features}, table.options());
  const CodebookKernels kern = codebook_kernels(active_cpu_path());
  parallel_for(0, w.N, 8, [&](int64_t n0, int64_t n1) { kern.decode(w, n0, n1, out.data_ptr<float>() + n0 * in_features); });
  return out;
}

at::Tensor tcq_linear_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& table, int64_t table_bits,
                          int64_t shift_bits, const at::Tensor& row_scales, const c10::optional<at::Tensor>& bias) {
  const char* op = "tcq_linear";
  const at::Tensor cc = codes.contiguous(), sc = row_scales.contiguous();
  TcqWeights w = tcq_weights(op, cc, table, table_bits, shift_bits, sc);
  check_linear_io(op, x, w.K, w.N, 0, bias, {});
  const at::Tensor x2 = activations_fp32(x, w.K);
  const int64_t M = x2.size(0), bands = w.N / kTcqTile;
  const TcqKernels kern = tcq_kernels(active_cpu_path());
  if (M > kPaletteFusedMaxTokens) {
    at::Tensor out = decode_matmul(x2, w.N, w.K, kTcqTile, [&](int64_t b0, int64_t b1, float* dst) { kern.decode(w, b0, b1, dst); });
    return finish_linear(out, x, bias);
  }
  const at::Tensor b32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  w.bias = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({M, w.N}, x2.options());
  if (M > 0)
    parallel_for(0, bands, 1, [&](int64_t b0, int64_t b1) { kern.gemv(w, x2.data_ptr<float>(), M, b0, b1, out.data_ptr<float>()); });
  return finish_linear(out, x, bias, /*bias_fused=*/true);
}

at::Tensor tcq_dequantize_cpu(const at::Tensor& codes, const at::Tensor& table, int64_t table_bits, int64_t shift_bits,
                              const at::Tensor& row_scales) {
  const at::Tensor cc = codes.contiguous(), sc = row_scales.contiguous();
  const TcqWeights w = tcq_weights("tcq_dequantize", cc, table, table_bits, shift_bits, sc);
  at::Tensor out = at::empty({w.N, w.K}, table.options());
  const TcqKernels kern = tcq_kernels(active_cpu_path());
  parallel_for(0, w.N / kTcqTile, 1, [&](int64_t b0, int64_t b1) {
    kern.decode(w, b0, b1, out.data_ptr<float>() + b0 * kTcqTile * w.K);
  });
  return out;
}

}  // namespace torch_lowbit
