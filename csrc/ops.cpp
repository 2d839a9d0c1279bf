// The C++ CPU kernels of the torch_lowbit custom ops (bound to the schemas of torch_lowbit/ops/schemas.py)
// and the small Python module. CUDA implementations (Triton) and fake (meta) implementations are
// registered from Python in torch_lowbit/ops/.
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
                             int64_t act_block, const c10::optional<at::Tensor>& sub_scales,
                             const c10::optional<at::Tensor>& sub_mins);
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
at::Tensor gvq_linear_cpu(const at::Tensor& x, const at::Tensor& codes, int64_t code_bits, const at::Tensor& planes,
                          int64_t tile_rows, int64_t tile_cols, const at::Tensor& row_scales,
                          const c10::optional<at::Tensor>& bias);
at::Tensor gvq_dequantize_cpu(const at::Tensor& codes, int64_t code_bits, const at::Tensor& planes, int64_t tile_rows,
                              int64_t tile_cols, const at::Tensor& row_scales, int64_t in_features);
at::Tensor kv_attention_cpu(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                            const at::Tensor& k_min, const at::Tensor& v_codes, const at::Tensor& v_scale,
                            const at::Tensor& v_min, const c10::optional<at::Tensor>& mask, double scale,
                            int64_t bits, const c10::optional<at::Tensor>& k_recent,
                            const c10::optional<at::Tensor>& v_recent, const c10::optional<at::Tensor>& recent_end);
at::Tensor kv_vq_attention_cpu(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_planes,
                               const at::Tensor& v_codes, const at::Tensor& v_planes,
                               const c10::optional<at::Tensor>& mask, double scale);
at::Tensor gqa_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& mask, double scale);
void register_hadamard_base(const at::Tensor& base);  // csrc/hadamard.cpp
void set_gvq_kernel_variant(const std::string& name);  // csrc/gvq_linear.cpp
int64_t read_probe(const at::Tensor& buf);
int64_t clock_probe(int64_t adds);
}  // namespace torch_lowbit

// The op table (every torch_lowbit schema) is defined in Python, torch_lowbit/ops/schemas.py, so the ops
// exist on installs without this extension. Here only the C++ CPU kernels are bound (also in
// hadamard.cpp / tcq_viterbi.cpp): the dispatcher accepts them whether the .so loads before or after the
// Python definitions, and checks each kernel's signature against its schema. Fake (meta) impls, CUDA
// (Triton) impls and the CPU impls of the ops with no C++ kernel are registered from Python, one module
// per op family: torch_lowbit/ops/<family>.py (hadamard_transform: torch_lowbit/rotations/ops.py).
TORCH_LIBRARY_IMPL(torch_lowbit, CPU, m) {
  m.impl("lut4_linear", &torch_lowbit::lut4_linear_cpu);
  m.impl("lut4_dequantize", &torch_lowbit::lut4_dequantize_cpu);
  m.impl("lut_i8_linear", &torch_lowbit::lut_i8_linear_cpu);
  m.impl("q4x_linear", &torch_lowbit::q4x_linear_cpu);
  m.impl("codebook_linear", &torch_lowbit::codebook_linear_cpu);
  m.impl("codebook_dequantize", &torch_lowbit::codebook_dequantize_cpu);
  m.impl("tcq_linear", &torch_lowbit::tcq_linear_cpu);
  m.impl("tcq_dequantize", &torch_lowbit::tcq_dequantize_cpu);
  m.impl("gvq_linear", &torch_lowbit::gvq_linear_cpu);
  m.impl("gvq_dequantize", &torch_lowbit::gvq_dequantize_cpu);
  m.impl("gqa_attention", &torch_lowbit::gqa_attention_cpu);
  m.impl("kv_attention", &torch_lowbit::kv_attention_cpu);
  m.impl("kv_vq_attention", &torch_lowbit::kv_vq_attention_cpu);
}

namespace torch_lowbit {
void register_native_decoder(pybind11::module& m);  // csrc/native_decoder.cpp
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_lowbit CPU kernels (ops are registered under torch.ops.torch_lowbit)";
  m.def("available_cpu_paths", &torch_lowbit::available_cpu_paths, "CPU kernel paths this CPU can run, best first");
  m.def("set_cpu_path", &torch_lowbit::set_cpu_path, "Force a CPU kernel path: auto, scalar, avx2, avxvnni, avx512");
  m.def("set_gvq_kernel", &torch_lowbit::set_gvq_kernel_variant,
        "Benchmark hook: the gvq_linear kernel for up to 8 tokens: tables (default), direct or decode");
  m.def("read_probe", &torch_lowbit::read_probe, "Streams a buffer with all threads (bandwidth probe)");
  m.def("clock_probe", &torch_lowbit::clock_probe, "Runs N dependent one-cycle steps (clock probe)");
  m.def("register_hadamard_base", &torch_lowbit::register_hadamard_base,
        "Checks a Hadamard base matrix H_k and adds it to the CPU kernel's table (torch_lowbit/rotations/ops.py)");
  m.def("get_cpu_path", &torch_lowbit::get_cpu_path, "The CPU kernel path in use");
  m.def("built_torch_version", []() { return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR); },
        "The torch major.minor this extension was compiled against (its ABI)");
  m.def("threading", [] { return std::string(torch_lowbit::uses_own_thread_pool() ? "pool" : "openmp"); },
        "How the CPU kernels are threaded now: pool or openmp");
  m.def("pool_threads", &torch_lowbit::pool_threads, "The pool's thread count (0: torch.get_num_threads())");
  m.def("pool_stats", &torch_lowbit::pool_stats, "[pool jobs, jobs with a stalled worker, jobs run inline after a stall, "
        "chunks the caller took back from a stalled worker, late worker results thrown away]");
  m.def("set_reclaim_test_delay_us", &torch_lowbit::set_reclaim_test_delay_us, "Test hook: pool workers sleep this "
        "long after claiming each chunk of a reclaimable job (0: off)");
  m.def("set_threading", &torch_lowbit::set_threading, "Choose the CPU kernels' scheduler (pool or openmp) and the "
        "pool's thread count (0: follow torch); torch_lowbit.set_num_threads is the public call");
  torch_lowbit::register_native_decoder(m);
  m.def("cpu_has_avx_vnni", &torch_lowbit::cpu_has_avx_vnni, "AVX-VNNI (vpdpbusd on ymm: the avxvnni path)");
  m.def("cpu_has_avx512_vnni", &torch_lowbit::cpu_has_avx512_vnni, "AVX-512 VNNI (int8 kernels of the avx512 path)");
  m.def("cpu_has_avx512_vbmi", &torch_lowbit::cpu_has_avx512_vbmi, "AVX-512 VBMI (palette kernels of the avx512 path)");
}
