// Runtime choice of the CPU kernel path (ISA) for every torch_lowbit CPU kernel.
//
// One build runs on any x86-64: optimized kernels are compiled with per-function `target`
// attributes and picked here from the CPU's features. TORCH_LOWBIT_CPU_PATH=scalar|avx2|avxvnni|avx512
// (or torch_lowbit.use_backend("cpu", path=...)) forces a path so tests can check every path
// against the portable scalar one on a single machine. avxvnni is AVX2 plus vpdpbusd on ymm (AVX-VNNI,
// or the same instruction EVEX-encoded on AVX512-VNNI CPUs without it): only the int8-activation
// kernels have a variant for it, every other kernel runs its AVX2 code there (kernel_isa folds it).
#pragma once
#include <string>
#include <vector>

namespace torch_lowbit {

// x86: scalar, avx2, avxvnni, avx512. aarch64: scalar, neon (every aarch64 CPU), dotprod (Armv8.2 sdot,
// HWCAP_ASIMDDP), i8mm (Armv8.6 smmla, HWCAP2_I8MM; the interleaved q4x layouts' GEMM, dotprod code
// elsewhere). ARM code (csrc/arm): the int8-weight kernels, the activation quantizers, Hadamard, KV-cache
// attention and the palette kernels (codebooks, TCQ); their dispatch checks __aarch64__ before
// kernel_isa. The others (lut4, the TCQ Viterbi search) run their scalar code there.
enum class CpuPath { Scalar = 0, Avx2 = 1, AvxVnni = 2, Avx512 = 3, Neon = 4, Dotprod = 5, I8mm = 6 };

// The path whose x86 code a kernel without an AVX-VNNI variant runs: avxvnni -> avx2; ARM paths -> scalar
// (what kernels without ARM code run; those with ARM code pick it before asking).
inline CpuPath kernel_isa(CpuPath p) {
  if (p == CpuPath::Neon || p == CpuPath::Dotprod || p == CpuPath::I8mm) return CpuPath::Scalar;
  return p == CpuPath::AvxVnni ? CpuPath::Avx2 : p;
}

// AVX-512 VNNI (vpdpbusd), used by the int8-activation kernels of the avx512 path.
bool cpu_has_avx512_vnni();
// AVX-512 VBMI (vpermb / vpermi2b), used by the palette kernels of the avx512 path.
bool cpu_has_avx512_vbmi();
// AVX-VNNI (vpdpbusd on ymm, VEX-encoded: Intel Alder Lake+, Sapphire Rapids+, AMD Zen 5).
bool cpu_has_avx_vnni();
// vpdpbusd on ymm in either encoding: AVX-VNNI, or AVX512-VNNI + VL (EVEX; Cascade Lake, Ice Lake, Zen 4),
// so the avxvnni path also runs (and is tested) on AVX-512 VNNI machines without AVX-VNNI.
bool cpu_has_vnni_ymm();
// Paths this CPU can execute, best first.
std::vector<std::string> available_cpu_paths();
// The path kernels use now: the forced one if set (and executable), else the best available.
CpuPath active_cpu_path();
std::string cpu_path_name(CpuPath p);
// Force a path by name ("auto" clears the override). Throws if the CPU cannot run it.
void set_cpu_path(const std::string& name);
std::string get_cpu_path();

}  // namespace torch_lowbit
