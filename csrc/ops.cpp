// Registration of the torch_lowbit custom ops (schemas + CPU kernels) and the small Python module.
// CUDA implementations (Triton) and fake (meta) implementations are registered from Python in
// torch_lowbit/ops/.
#include <torch/extension.h>
#include <torch/version.h>

#include <string>

#include "common/dispatch.h"
#include "common/parallel.h"

namespace torch_lowbit {
at::Tensor lut4_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t group,
                           const c10::optional<at::Tensor>& bias);
at::Tensor lut4_dequantize_cpu(const at::Tensor& qweight, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t group);
at::Tensor lut_i8_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t code_bits,
                             int64_t group, int64_t out_features, const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& sub_groups, int64_t act_bits, double act_clip,
                             int64_t act_block);
at::Tensor q4x_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const at::Tensor& lut, int64_t rows, int64_t chunk, int64_t group, int64_t out_features,
                          const c10::optional<at::Tensor>& bias, int64_t act_bits, double act_clip, int64_t act_block);
at::Tensor codebook_linear_cpu(const at::Tensor& x, const at::Tensor& codes, int64_t code_bits, const at::Tensor& table,
                               const at::Tensor& row_scales, const c10::optional<at::Tensor>& bias);
at::Tensor codebook_dequantize_cpu(const at::Tensor& codes, int64_t code_bits, const at::Tensor& table,
                                   const at::Tensor& row_scales, int64_t in_features);
at::Tensor tcq_linear_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& table, int64_t table_bits,
                          int64_t shift_bits, const at::Tensor& row_scales, const c10::optional<at::Tensor>& bias);
at::Tensor tcq_dequantize_cpu(const at::Tensor& codes, const at::Tensor& table, int64_t table_bits, int64_t shift_bits,
                              const at::Tensor& row_scales);
at::Tensor kv_attention_cpu(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                            const at::Tensor& k_min, const at::Tensor& v_codes, const at::Tensor& v_scale,
                            const at::Tensor& v_min, const c10::optional<at::Tensor>& mask, double scale,
                            int64_t bits, const c10::optional<at::Tensor>& k_recent,
                            const c10::optional<at::Tensor>& v_recent, const c10::optional<at::Tensor>& recent_end);
at::Tensor gqa_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& mask, double scale);
void register_base(const at::Tensor& base);  // csrc/hadamard.cpp
int64_t read_probe(const at::Tensor& buf);
int64_t clock_probe(int64_t adds);
}  // namespace torch_lowbit

// The op table: every torch_lowbit op's schema, here and nowhere else. CPU kernels are bound below
// and in hadamard.cpp / tcq_viterbi.cpp; fake (meta) impls, CUDA (Triton) impls and the CPU impls of
// the ops that have no C++ kernel (lowbit_*, gcb_*: the layout's reference decoder, tcq_half_linear:
// two tcq_linear calls) are registered from Python, one module per op family: torch_lowbit/ops/<family>.py
// (lut4, lut_i8, q4x, palette, lowbit, gcb, attention; hadamard_transform: torch_lowbit/rotations/ops.py).
TORCH_LIBRARY(torch_lowbit, m) {
  m.def("lut4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, int group_size, "
        "Tensor? bias) -> Tensor");
  m.def("lut_i8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, int code_bits, "
        "int group_size, int out_features, Tensor? bias, Tensor? sub_groups=None, int act_bits=0, "
        "float act_clip=1.0, int act_block=0) -> Tensor");
  // the interleaved ARM layouts q4_{R}x{S} (common/q4x.h, layouts/q4x.py)
  m.def("q4x_linear(Tensor x, Tensor qweight, Tensor scales, Tensor lut, int rows, int chunk, int group_size, "
        "int out_features, Tensor? bias, int act_bits=0, float act_clip=1.0, int act_block=0) -> Tensor");
  m.def("lut4_dequantize(Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, int group_size) -> Tensor");
  // integer activations (x rounded per token, act_block 0, or per 32 features, act_block 32 / 16 / 8:
  // act_codes.quantize_act_codes) x lut4_rowmajor weights (int8 table): fp32 [M, N]; CUDA: Triton's integer
  // tl.dot (triton_kernels/int_act.py), CPU: the reference in Python
  m.def("lut4_int_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, int group_size, "
        "Tensor? bias, int act_bits, float act_clip, int act_block=0) -> Tensor");
  m.def("codebook_linear(Tensor x, Tensor codes, int code_bits, Tensor table, Tensor row_scales, Tensor? bias) -> Tensor");
  m.def("codebook_dequantize(Tensor codes, int code_bits, Tensor table, Tensor row_scales, int in_features) -> Tensor");
  m.def("tcq_linear(Tensor x, Tensor codes, Tensor table, int table_bits, int shift_bits, Tensor row_scales, "
        "Tensor? bias) -> Tensor");
  m.def("tcq_dequantize(Tensor codes, Tensor table, int table_bits, int shift_bits, Tensor row_scales) -> Tensor");
  // half-TCQ as one op, so a CUDA model runs both halves of K in one Triton launch
  m.def("tcq_half_linear(Tensor x, Tensor codes_lo, Tensor table_lo, int table_bits_lo, int shift_bits_lo, "
        "Tensor codes_hi, Tensor table_hi, int table_bits_hi, int shift_bits_hi, Tensor row_scales, "
        "Tensor? bias) -> Tensor");
  // the off-CPU layouts of the sub-4-bit group formats (layouts/stream_rowmajor.py, layouts/gcb.py gcb_rowmajor)
  m.def("lowbit_linear(Tensor x, Tensor codes, int code_bits, Tensor scales, Tensor? mins, Tensor lut, "
        "int group_size, Tensor? bias) -> Tensor");
  m.def("lowbit_dequantize(Tensor codes, int code_bits, Tensor scales, Tensor? mins, Tensor lut, "
        "int group_size) -> Tensor");
  m.def("gcb_linear(Tensor x, Tensor codes, int code_bits, Tensor sub_groups, Tensor super_scales, "
        "Tensor codebooks, Tensor? bias) -> Tensor");
  m.def("gcb_dequantize(Tensor codes, int code_bits, Tensor sub_groups, Tensor super_scales, "
        "Tensor codebooks) -> Tensor");
  m.def("hadamard_transform(Tensor x, Tensor? signs, bool inverse) -> Tensor");
  m.def("_hadamard_register_base(Tensor base) -> ()", &torch_lowbit::register_base);
  m.def("tcq_viterbi(Tensor sequences, Tensor state_values, int shift_bits) -> (Tensor states, Tensor errors)");
  // grouped-query attention of compiled generation (torch_lowbit/generation.py), [B, S, H, D] out
  m.def("gqa_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  // the same over a group-wise quantized KV cache (torch_lowbit/kv_cache.py), [B, S, H, D] out
  m.def("kv_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_min, Tensor v_codes, Tensor v_scale, "
        "Tensor v_min, Tensor? mask, float scale, int bits, Tensor? k_recent=None, Tensor? v_recent=None, "
        "Tensor? recent_end=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_lowbit, CPU, m) {
  m.impl("lut4_linear", &torch_lowbit::lut4_linear_cpu);
  m.impl("lut4_dequantize", &torch_lowbit::lut4_dequantize_cpu);
  m.impl("lut_i8_linear", &torch_lowbit::lut_i8_linear_cpu);
  m.impl("q4x_linear", &torch_lowbit::q4x_linear_cpu);
  m.impl("codebook_linear", &torch_lowbit::codebook_linear_cpu);
  m.impl("codebook_dequantize", &torch_lowbit::codebook_dequantize_cpu);
  m.impl("tcq_linear", &torch_lowbit::tcq_linear_cpu);
  m.impl("tcq_dequantize", &torch_lowbit::tcq_dequantize_cpu);
  m.impl("gqa_attention", &torch_lowbit::gqa_attention_cpu);
  m.impl("kv_attention", &torch_lowbit::kv_attention_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_lowbit CPU kernels (ops are registered under torch.ops.torch_lowbit)";
  m.def("available_cpu_paths", &torch_lowbit::available_cpu_paths, "CPU kernel paths this CPU can run, best first");
  m.def("set_cpu_path", &torch_lowbit::set_cpu_path, "Force a CPU kernel path: auto, scalar, avx2, avxvnni, avx512");
  m.def("read_probe", &torch_lowbit::read_probe, "Streams a buffer with all threads (bandwidth probe)");
  m.def("clock_probe", &torch_lowbit::clock_probe, "Runs N dependent one-cycle steps (clock probe)");
  m.def("get_cpu_path", &torch_lowbit::get_cpu_path, "The CPU kernel path in use");
  m.def("built_torch_version", []() { return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR); },
        "The torch major.minor this extension was compiled against (its ABI)");
  m.def("threading", [] { return std::string(torch_lowbit::uses_own_thread_pool() ? "pool" : "openmp"); },
        "How the CPU kernels are threaded: pool (TORCH_LOWBIT_THREADS / OMP_WAIT_POLICY=passive) or openmp");
  m.def("cpu_has_avx_vnni", &torch_lowbit::cpu_has_avx_vnni, "AVX-VNNI (vpdpbusd on ymm: the avxvnni path)");
  m.def("cpu_has_avx512_vnni", &torch_lowbit::cpu_has_avx512_vnni, "AVX-512 VNNI (int8 kernels of the avx512 path)");
  m.def("cpu_has_avx512_vbmi", &torch_lowbit::cpu_has_avx512_vbmi, "AVX-512 VBMI (palette kernels of the avx512 path)");
}
