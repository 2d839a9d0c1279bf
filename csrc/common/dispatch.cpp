#include "common/dispatch.h"

#include <c10/util/Exception.h>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

#include <atomic>
#include <cstdlib>
#include <string>

namespace torch_lowbit {
namespace {

// TORCH_LOWBIT_CPU_MAX_PATH=scalar|avx2|avxvnni|avx512 makes the library treat the CPU as lacking every ISA
// above that path (read once), so an AVX-512 machine can run the whole suite as an AVX2-only one.
// On aarch64 the levels are scalar 0, neon 1, dotprod 2, i8mm 3.
int max_path_from_env() {
  const char* env = std::getenv("TORCH_LOWBIT_CPU_MAX_PATH");
  if (env == nullptr || std::string(env).empty() || std::string(env) == "avx512" || std::string(env) == "i8mm") return 3;
  if (std::string(env) == "avxvnni" || std::string(env) == "dotprod") return 2;
  if (std::string(env) == "avx2" || std::string(env) == "neon") return 1;
  if (std::string(env) == "scalar") return 0;
  TORCH_CHECK(false, "torch_lowbit: unknown TORCH_LOWBIT_CPU_MAX_PATH '", env,
              "'; choose one of scalar, avx2, avxvnni, avx512 (x86) or scalar, neon, dotprod, i8mm (aarch64)");
}

int max_path() {
  static const int cap = max_path_from_env();
  return cap;
}

bool cpu_has_avx2() {
#if defined(TORCH_LOWBIT_X86)
  return max_path() >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(TORCH_LOWBIT_X86)
  return max_path() >= 3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// Advanced SIMD is part of every aarch64 Linux target; dotprod (sdot/udot) from Armv8.2 where HWCAP says so.
bool cpu_has_neon() {
#if defined(__aarch64__)
  return max_path() >= 1;
#else
  return false;
#endif
}

bool cpu_has_dotprod() {
#if defined(__aarch64__) && defined(__linux__)
  return max_path() >= 2 && (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
  return false;
#endif
}

bool cpu_has_i8mm() {
#if defined(__aarch64__) && defined(__linux__)
  return max_path() >= 3 && cpu_has_dotprod() && (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#else
  return false;
#endif
}

}  // namespace

bool cpu_has_avx512_vbmi() {
#if defined(TORCH_LOWBIT_X86)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

bool cpu_has_avx_vnni() {
#if defined(TORCH_LOWBIT_X86)
  return max_path() >= 2 && cpu_has_avx2() && __builtin_cpu_supports("avxvnni");
#else
  return false;
#endif
}

bool cpu_has_vnni_ymm() {
#if defined(TORCH_LOWBIT_X86)
  return cpu_has_avx_vnni() ||
         (max_path() >= 2 && cpu_has_avx2() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"));
#else
  return false;
#endif
}

bool cpu_has_avx512_vnni() {
#if defined(TORCH_LOWBIT_X86)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

namespace {

bool can_run(CpuPath p) {
  switch (p) {
    case CpuPath::Scalar: return true;
    case CpuPath::Avx2: return cpu_has_avx2();
    case CpuPath::AvxVnni: return cpu_has_vnni_ymm();
    case CpuPath::Avx512: return cpu_has_avx512();
    case CpuPath::Neon: return cpu_has_neon();
    case CpuPath::Dotprod: return cpu_has_dotprod();
    case CpuPath::I8mm: return cpu_has_i8mm();
  }
  return false;
}

CpuPath parse(const std::string& name) {
  if (name == "scalar") return CpuPath::Scalar;
  if (name == "avx2") return CpuPath::Avx2;
  if (name == "avxvnni") return CpuPath::AvxVnni;
  if (name == "avx512") return CpuPath::Avx512;
  if (name == "neon") return CpuPath::Neon;
  if (name == "dotprod") return CpuPath::Dotprod;
  if (name == "i8mm") return CpuPath::I8mm;
  TORCH_CHECK(false, "torch_lowbit: unknown CPU path '", name,
              "'; choose one of auto, scalar, avx2, avxvnni, avx512 (x86), neon, dotprod, i8mm (aarch64)");
}

CpuPath best_path() {
  if (cpu_has_i8mm()) return CpuPath::I8mm;
  if (cpu_has_dotprod()) return CpuPath::Dotprod;
  if (cpu_has_neon()) return CpuPath::Neon;
  if (cpu_has_avx512()) return CpuPath::Avx512;
  if (cpu_has_avx_vnni()) return CpuPath::AvxVnni;
  if (cpu_has_avx2()) return CpuPath::Avx2;
  return CpuPath::Scalar;
}

// -1: no override. Initialized from the environment on first use.
std::atomic<int> forced{-2};

int forced_from_env() {
  const char* env = std::getenv("TORCH_LOWBIT_CPU_PATH");
  if (env == nullptr || std::string(env).empty() || std::string(env) == "auto") return -1;
  CpuPath p = parse(env);
  TORCH_CHECK(can_run(p), "torch_lowbit: TORCH_LOWBIT_CPU_PATH=", env,
              " but this CPU cannot run it; available: scalar",
              cpu_has_avx2() ? ", avx2" : "", cpu_has_vnni_ymm() ? ", avxvnni" : "", cpu_has_avx512() ? ", avx512" : "",
              cpu_has_neon() ? ", neon" : "", cpu_has_dotprod() ? ", dotprod" : "", cpu_has_i8mm() ? ", i8mm" : "");
  return static_cast<int>(p);
}

}  // namespace

std::string cpu_path_name(CpuPath p) {
  switch (p) {
    case CpuPath::Scalar: return "scalar";
    case CpuPath::Avx2: return "avx2";
    case CpuPath::AvxVnni: return "avxvnni";
    case CpuPath::Avx512: return "avx512";
    case CpuPath::Neon: return "neon";
    case CpuPath::Dotprod: return "dotprod";
    case CpuPath::I8mm: return "i8mm";
  }
  return "?";
}

std::vector<std::string> available_cpu_paths() {
  std::vector<std::string> out;
  if (cpu_has_avx512()) out.push_back("avx512");
  if (cpu_has_vnni_ymm()) out.push_back("avxvnni");
  if (cpu_has_avx2()) out.push_back("avx2");
  if (cpu_has_i8mm()) out.push_back("i8mm");
  if (cpu_has_dotprod()) out.push_back("dotprod");
  if (cpu_has_neon()) out.push_back("neon");
  out.push_back("scalar");
  return out;
}

CpuPath active_cpu_path() {
  int f = forced.load();
  if (f == -2) {
    f = forced_from_env();
    forced.store(f);
  }
  return f >= 0 ? static_cast<CpuPath>(f) : best_path();
}

void set_cpu_path(const std::string& name) {
  if (name == "auto") {
    forced.store(-1);
    return;
  }
  CpuPath p = parse(name);
  TORCH_CHECK(can_run(p), "torch_lowbit: this CPU cannot run the '", name, "' path");
  forced.store(static_cast<int>(p));
}

std::string get_cpu_path() { return cpu_path_name(active_cpu_path()); }

}  // namespace torch_lowbit
