// torch_lowbit::lut_i8_linear on CPU: activations quantized once per call to int8 (per-32 fp32
// scales; or per token to act_bits, QuaRot's A8 / A4, with act_block 32 one scale per 32 features),
// then the tiled integer kernel of the active
// ISA path, threaded over 16-row tiles.
#include <ATen/ATen.h>

#include <algorithm>

#include "common/act_buffers.h"
#include "common/dispatch.h"
#include "common/linear_io.h"
#include "common/lut_i8.h"
#include "common/lut_i8_prepared.h"
#include "common/parallel.h"

namespace torch_lowbit {
namespace {

#if defined(TORCH_LOWBIT_X86)
// The 256-bit vpdpbusd kernel: VEX (AVX-VNNI) where the CPU has it, else the EVEX encoding of the same code.
LutI8Fn vnni_ymm_kernel() { return cpu_has_avx_vnni() ? lut_i8_avxvnni : lut_i8_avxvnni_evex; }
#endif

LutI8Fn kernel_for(CpuPath p, bool row_codebooks, bool sub_scaled, int bits) {
#if defined(TORCH_LOWBIT_X86)
  // K-quants' integer sub-scales and 5- / 6-bit codes: the AVX-512 VNNI kernel, else the AVX2 one (the
  // 256-bit VNNI kernels have no sub-scaled mode); on ARM the NEON / dotprod kernels below take them too
  if (sub_scaled || bits == 5 || bits == 6) {
    if (p == CpuPath::Avx512 && cpu_has_avx512_vnni()) return lut_i8_avx512vnni;
    if (p == CpuPath::Avx512 || p == CpuPath::AvxVnni || p == CpuPath::Avx2) return lut_i8_avx2;
  }
#endif
#if defined(TORCH_LOWBIT_X86)
  if (row_codebooks && p == CpuPath::Avx512 && cpu_has_avx512_vnni() && cpu_has_avx512_vbmi())
    return lut_i8_avx512vbmi;
  if (row_codebooks && p == CpuPath::Avx512) return cpu_has_vnni_ymm() ? vnni_ymm_kernel() : lut_i8_avx2;  // vpermb needs VBMI
  if (p == CpuPath::Avx512 && cpu_has_avx512_vnni()) return lut_i8_avx512vnni;
  if (p == CpuPath::AvxVnni || (p == CpuPath::Avx512 && cpu_has_vnni_ymm())) return vnni_ymm_kernel();
  if (p == CpuPath::Avx512 || p == CpuPath::Avx2) return lut_i8_avx2;  // AVX-512 without VNNI: AVX2
#endif
#if defined(__aarch64__)
  if (p == CpuPath::Dotprod || p == CpuPath::I8mm) return lut_i8_dotprod;
  if (p == CpuPath::Neon) return lut_i8_neon;
#endif
  (void)p;
  (void)row_codebooks;
  return lut_i8_scalar;
}

}  // namespace

LutI8Prepared prepare_lut_i8(const char* op, const at::Tensor& qweight, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t code_bits,
                             int64_t group, int64_t out_features, const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& sub_groups,
                             const c10::optional<at::Tensor>& sub_scales, const c10::optional<at::Tensor>& sub_mins) {
  // the widths of torch_lowbit.core.packing.LUT_I8_CODE_BITS (the Python side's one definition: keep equal)
  TORCH_CHECK((code_bits >= 1 && code_bits <= 6) || code_bits == 8, op, ": code_bits must be 1..6 or 8, got ",
              code_bits);
  const int64_t block_bytes = lut_i8_block_bytes(static_cast<int>(code_bits));
  // A [2, 2^b] table: a 2-D codebook, one code per pair of features (lut_i8.h, "pair codebooks").
  const bool pairs = lut.dim() == 2;
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 3 && qweight.size(2) == block_bytes,
              op, ": qweight must be uint8 [N/16, K/", pairs ? 64 : 32, ", ", block_bytes, "] for ", code_bits,
              "-bit codes");
  const int64_t tiles = qweight.size(0), K = qweight.size(1) * (pairs ? 64 : 32), N = out_features;
  TORCH_CHECK(N > (tiles - 1) * kI8TileRows && N <= tiles * kI8TileRows,
              op, ": out_features ", N, " does not match ", tiles, " tiles of 16 rows");
  check_linear_params(op, K, N, group, bias, {&qweight, &scales, &lut});
  check_group_params(op, scales, mins, {tiles, K / group, kI8TileRows});
  const int64_t entries = lut.numel(), per_table = int64_t{1} << code_bits;
  if (pairs) {
    TORCH_CHECK(lut.scalar_type() == at::kChar && lut.size(0) == 2 && lut.size(1) == per_table && code_bits <= 4,
                op, ": a pair codebook's lut must be int8 [2, ", per_table, "] (one table per coordinate) ",
                "with codes of at most 4 bits, got ", lut.sizes(), " for ", code_bits, "-bit codes");
    TORCH_CHECK(!sub_groups.has_value(), op, ": pair codebooks take no sub_groups");
    TORCH_CHECK(group % 64 == 0, op, ": pair codebooks need groups of 64k features, got ", group);
  } else if (sub_groups.has_value()) {  // group codebooks: several tables, one picked per (row, block)
    // torch_lowbit.core.packing.GCB_CODE_BITS (keep equal)
    TORCH_CHECK(code_bits == 2 || code_bits == 3, op, ": sub_groups (group codebooks) need 2- or 3-bit codes");
    TORCH_CHECK(sub_groups->scalar_type() == at::kByte && sub_groups->dim() == 3 && sub_groups->size(0) == tiles &&
                    sub_groups->size(1) == K / 32 && sub_groups->size(2) == kI8TileRows,
                op, ": sub_groups must be uint8 [", tiles, ", ", K / 32, ", 16]");
    TORCH_CHECK(sub_groups->device().is_cpu(), op, ": sub_groups must be on the CPU");
    TORCH_CHECK(!mins.has_value(), op, ": group codebooks take no mins");
    TORCH_CHECK(lut.scalar_type() == at::kChar && entries % per_table == 0 && entries > 0 && entries <= 16 * per_table,
                op, ": lut must be 1..16 int8 codebooks of ", per_table, " entries back to back, got ", entries,
                " values");
  } else {
    TORCH_CHECK(lut.scalar_type() == at::kChar && lut.dim() == 1 && entries == per_table, op, ": lut must be ",
                per_table, " int8 values for ", code_bits, "-bit codes");
  }
  int64_t sub_block = 32;
  if (sub_scales.has_value()) {  // integer sub-scales (K-quants, lut_i8.h)
    TORCH_CHECK(!pairs && !sub_groups.has_value() && code_bits != 8, op,
                ": sub_scales take one table of codes up to 6 bits, no pairs or sub_groups");
    TORCH_CHECK(sub_scales->scalar_type() == at::kChar && sub_scales->dim() == 3 && sub_scales->size(0) == tiles &&
                    sub_scales->size(2) == kI8TileRows && (sub_scales->size(1) == K / 16 || sub_scales->size(1) == K / 32),
                op, ": sub_scales must be int8 [", tiles, ", K/16 or K/32, 16] with K=", K, ", got ", sub_scales->sizes());
    sub_block = K / sub_scales->size(1);
    TORCH_CHECK(group % sub_block == 0, op, ": the group (", group, ") must hold whole sub-blocks of ", sub_block);
    TORCH_CHECK(sub_scales->device().is_cpu(), op, ": sub_scales must be on the CPU");
    TORCH_CHECK(sub_mins.has_value() == mins.has_value(), op,
                ": sub_mins and mins come together (the super-block's -dmin is mins)");
    if (sub_mins.has_value())
      TORCH_CHECK(sub_mins->scalar_type() == at::kByte && sub_mins->sizes() == sub_scales->sizes() &&
                      sub_mins->device().is_cpu(),
                  op, ": sub_mins must be uint8 on the CPU, shaped as sub_scales ", sub_scales->sizes());
  } else {
    TORCH_CHECK(!sub_mins.has_value(), op, ": sub_mins need sub_scales");
  }

  LutI8Prepared p;
  p.qweight = qweight.contiguous(), p.scales = scales.contiguous(), p.lut = lut.contiguous();
  const at::Tensor& qw = p.qweight, &sc = p.scales, &lt = p.lut;
  if (mins.has_value()) p.mins = mins->contiguous();
  if (bias.has_value()) p.bias = bias->to(at::kFloat).contiguous();
  if (sub_groups.has_value()) p.sub_groups = sub_groups->contiguous();
  if (sub_scales.has_value()) p.sub_scales = sub_scales->contiguous();
  if (sub_mins.has_value()) p.sub_mins = sub_mins->contiguous();
  const at::Tensor &mn = p.mins, &b32 = p.bias, &sg = p.sub_groups;
  LutI8Weights& w = p.w;
  w = LutI8Weights{qw.data_ptr<uint8_t>(), sc.data_ptr<c10::Half>(),
                 mins.has_value() ? mn.data_ptr<c10::Half>() : nullptr,
                 sub_groups.has_value() ? sg.data_ptr<uint8_t>() : nullptr, {}, 0, N, K, group,
                 bias.has_value() ? b32.data_ptr<float>() : nullptr, static_cast<int>(code_bits), pairs};
  if (sub_scales.has_value()) {
    w.sub_scales = p.sub_scales.data_ptr<int8_t>();
    w.sub_mins = sub_mins.has_value() ? p.sub_mins.data_ptr<uint8_t>() : nullptr;
    w.sub_block = static_cast<int>(sub_block);
  }
  const int8_t* table = lt.data_ptr<int8_t>();
  w.offset = -*std::min_element(table, table + entries);
  for (int i = 0; i < entries; ++i) {
    TORCH_CHECK(table[i] + w.offset <= 255, op, ": table spans more than 256 values");
    w.utable[i] = static_cast<uint8_t>(table[i] + w.offset);
    // 8-bit codes are read as the bytes themselves (no 256-entry lookup on the SIMD paths): q8_0's code - 128
    TORCH_CHECK(code_bits != 8 || table[i] == i - 128, op, ": 8-bit codes need the table code - 128 (q8_0), "
                "entry ", i, " is ", static_cast<int>(table[i]));
    // 5- and 6-bit codes are read as they are too (no 32- or 64-entry lookup): the table code - offset
    TORCH_CHECK(code_bits < 5 || code_bits > 6 || table[i] == table[0] + i, op, ": ", code_bits,
                "-bit codes need the table code + ", static_cast<int>(table[0]), " (consecutive values), entry ", i,
                " is ", static_cast<int>(table[i]));
  }

  p.tiles = tiles;
  return p;
}

LutI8Fn lut_i8_kernel(const LutI8Weights& w) {
  return kernel_for(active_cpu_path(), w.sub_groups != nullptr, w.sub_scales != nullptr, w.bits);
}

at::Tensor lut_i8_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, const at::Tensor& lut, int64_t code_bits,
                             int64_t group, int64_t out_features, const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& sub_groups, int64_t act_bits, double act_clip,
                             int64_t act_block, const c10::optional<at::Tensor>& sub_scales,
                             const c10::optional<at::Tensor>& sub_mins) {
  const LutI8Prepared p = prepare_lut_i8("lut_i8_linear", qweight, scales, mins, lut, code_bits, group, out_features,
                                         bias, sub_groups, sub_scales, sub_mins);
  const LutI8Weights& w = p.w;
  const int64_t K = w.K, N = w.N;
  check_linear_io("lut_i8_linear", x, K, N, group, bias, {});
  TORCH_CHECK(!w.sub_scales || act_bits == 0, "lut_i8_linear: sub_scales (K-quants) take int8 activations per 32 "
              "features (act_bits 0), got act_bits=", act_bits);
  TORCH_CHECK(!w.pairs || act_bits == 0, "lut_i8_linear: pair codebooks take int8 activations per 32 features (act_bits 0), "
              "got act_bits=", act_bits, "; round x per token before the call instead");
  at::Tensor x2 = activations_fp32(x, K);
  const int64_t M = x2.size(0);
  if (w.pairs)  // pair-split order: per 64 features, the 32 first coordinates, then the 32 second ones
    x2 = x2.view({M, K / 64, 32, 2}).transpose(2, 3).contiguous().view({M, K});
  // The activation buffers: the only allocation on the hot path besides the output.
  const ActBuffers acts = lut_i8_activations("lut_i8_linear", p, x2, act_bits, act_clip, act_block);
  at::Tensor out = at::empty({M, N}, x2.options());
  if (M > 0) {
    const LutI8Fn kern = lut_i8_kernel(w);
    float* op = out.data_ptr<float>();
    parallel_for(0, p.tiles, 1, [&](int64_t t0, int64_t t1) { kern(w, acts.acts, t0, t1, op, N); });
  }
  return finish_linear(out, x, bias, /*bias_fused=*/true);
}

}  // namespace torch_lowbit
