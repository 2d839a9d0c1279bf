// Registration of the torch_lowbit custom ops (schemas + CPU kernels) and the small Python module.
// CUDA implementations (Triton) and fake (meta) implementations are registered from Python in
// torch_lowbit/ops/.
#include <torch/extension.h>

#include "common/dispatch.h"

namespace torch_lowbit {
at::Tensor lut4_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t group,
                           const c10::optional<at::Tensor>& bias);
at::Tensor lut4_dequantize_cpu(const at::Tensor& qweight, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t group);
at::Tensor lut_i8_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t code_bits,
                             int64_t group, int64_t out_features, const c10::optional<at::Tensor>& bias);
int64_t read_probe(const at::Tensor& buf);
}  // namespace torch_lowbit

TORCH_LIBRARY(torch_lowbit, m) {
  m.def("lut4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, int group_size, "
        "Tensor? bias) -> Tensor");
  m.def("lut_i8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, int code_bits, "
        "int group_size, int out_features, Tensor? bias) -> Tensor");
  m.def("lut4_dequantize(Tensor qweight, Tensor scales, Tensor? mins, Tensor lut, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_lowbit, CPU, m) {
  m.impl("lut4_linear", &torch_lowbit::lut4_linear_cpu);
  m.impl("lut4_dequantize", &torch_lowbit::lut4_dequantize_cpu);
  m.impl("lut_i8_linear", &torch_lowbit::lut_i8_linear_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_lowbit CPU kernels (ops are registered under torch.ops.torch_lowbit)";
  m.def("available_cpu_paths", &torch_lowbit::available_cpu_paths, "CPU kernel paths this CPU can run, best first");
  m.def("set_cpu_path", &torch_lowbit::set_cpu_path, "Force a CPU kernel path: auto, scalar, avx2, avx512");
  m.def("read_probe", &torch_lowbit::read_probe, "Streams a buffer with all threads (bandwidth probe)");
  m.def("get_cpu_path", &torch_lowbit::get_cpu_path, "The CPU kernel path in use");
}
