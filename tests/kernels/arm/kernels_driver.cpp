// Standalone check of the ARM int8-weight kernels (no Python, no torch library: runs under
// qemu-aarch64). Reads test vectors written by tests/kernels/arm/test_arm_kernels.py (weights packed by the
// Python layouts, activations quantized by the Python twin of the kernels' quantizer, and the
// output of the x86 scalar kernel): first the int8-tile cases (lut_i8: scalar, NEON and, where HWCAP
// says so, dotprod; the K-quants with their integer sub-scales among them), then the interleaved
// q4_RxS cases (q4x: scalar, dotprod for S = 4, i8mm for S = 8), and requires each path to equal the x86 scalar output bit for bit; then the palette kernels (palette.h,
// TCQ (1mad and hybrid codes), then the codebook formats nuq / vq: scalar and NEON decode bit for bit the
// x86 scalar decode; the NEON GEMVs, which sum in another order, within fp32 rounding of the x86
// scalar GEMV, the scalar codebook GEMV equal to it); then the Hadamard kernels (NEON equal to the
// portable scalar code bit for bit, which is within fp32 rounding of a float64 transform); last the
// KV-cache attention tasks (scalar and NEON within fp32 rounding of a float64 softmax).
//   usage: kernels_driver VECTORS.bin     prints one line per case and path; exit 0 iff all equal
#include <sys/auxv.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "common/act_q8.h"
#include "common/hadamard.h"
#include "common/kv_attention.h"
#include "common/lut_i8.h"
#include "common/palette.h"
#include "common/q4x.h"

#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif

using namespace torch_lowbit;

namespace {

struct Reader {
  FILE* f;
  template <typename T>
  std::vector<T> read(size_t n) {
    std::vector<T> v(n);
    if (n && fread(v.data(), sizeof(T), n, f) != n) throw std::string("truncated vector file");
    return v;
  }
  int64_t i64() { return read<int64_t>(1)[0]; }
};

// The NEON activation quantizers on the case's floats give the Python twin's codes, scales and sums.
bool quantizer_matches(const std::vector<float>& x, const std::vector<int8_t>& xq, const std::vector<float>& xd,
                       const std::vector<int32_t>& xsum, int64_t M, int64_t K, int64_t act_bits, int64_t act_block,
                       int64_t c) {
  const int64_t kb = K / 32;
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * kb);
  std::vector<int32_t> s(M * kb);
  if (act_bits == 0) {
    quantize_act_blocks_neon(x.data(), 0, M * kb, q.data(), d.data(), s.data());
  } else if (act_block) {  // as quantize_acts_sub_blocks with clip 0.9, the NEON codes
    const float ratio = static_cast<float>(0.9 / ((1 << (act_bits - 1)) - 1));
    for (int64_t b = 0; b < M * kb; ++b)
      quantize_sub_block32(x.data() + b * 32, static_cast<int>(act_block), static_cast<int>(act_bits), ratio,
                           quantize_token_neon, q.data() + b * 32, d.data() + b, s.data() + b);
  } else {  // as quantize_acts_per_token with clip 0.9: amax * float(clip / qmax), then the NEON codes
    const int qmax = (1 << (act_bits - 1)) - 1, qmin = act_bits == 8 ? -qmax : -qmax - 1;
    for (int64_t m = 0; m < M; ++m) {
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[m * K + k]));
      float dt = amax * static_cast<float>(0.9 / qmax);
      if (!(dt > 0.f)) dt = 1.f;
      quantize_token_neon(x.data() + m * K, K, dt, qmin, qmax, q.data() + m * K);
      for (int64_t b = 0; b < kb; ++b) d[m * kb + b] = dt;
    }
  }
  const bool ok = std::memcmp(q.data(), xq.data(), M * K) == 0 && std::memcmp(d.data(), xd.data(), 4 * M * kb) == 0 &&
                  ((act_bits != 0 && !act_block) || std::memcmp(s.data(), xsum.data(), 4 * M * kb) == 0);
  printf("case %lld act_bits=%lld act_block=%lld neon activation quantizer: %s\n", (long long)c, (long long)act_bits,
         (long long)act_block, ok ? "equal" : "MISMATCH");
  return ok;
}

// Runs fn over units (tiles / row groups) [0, units) in two calls over disjoint ranges, as the threads
// do, and counts the outputs that differ from `expected` in any bit (printing the first).
template <class Weights, class Fn>
int64_t mismatches(Fn fn, const Weights& w, const Q8Acts& a, int64_t units, int64_t N,
                   const std::vector<float>& expected) {
  std::vector<float> out(a.M * N, -1.f);
  fn(w, a, 0, units / 2, out.data(), N);
  fn(w, a, units / 2, units, out.data(), N);
  int64_t bad = 0;
  for (int64_t i = 0; i < a.M * N; ++i)
    if (std::memcmp(&out[i], &expected[i], sizeof(float)) != 0 && bad++ == 0)
      printf("  first difference at %lld: %.9g vs %.9g\n", (long long)i, out[i], expected[i]);
  return bad;
}

// Counts the GEMV outputs y[m N + n] farther from `expected` than fp32 sums in another order can be:
// 1e-4 of bound[m N + n] (the sum of |w x'| the kernel adds up, and any terms it adds besides) + 1e-6.
int64_t gemv_far(const std::vector<float>& y, const std::vector<float>& expected, const std::vector<double>& bound,
                 int64_t N) {
  int64_t bad = 0;
  for (size_t i = 0; i < y.size(); ++i)
    if (!(std::fabs(y[i] - expected[i]) <= 1e-4 * bound[i] + 1e-6) && bad++ == 0)
      printf("  first GEMV difference at m=%lld n=%lld: %.9g vs %.9g\n", (long long)(i / N), (long long)(i % N), y[i],
             expected[i]);
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s VECTORS.bin\n", argv[0]);
    return 2;
  }
  FILE* f = fopen(argv[1], "rb");
  if (!f) {
    fprintf(stderr, "cannot open %s\n", argv[1]);
    return 2;
  }
  const bool dotprod = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
  const bool i8mm = dotprod && (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
  printf("dotprod: %s\n", dotprod ? "yes" : "no (path skipped)");
  printf("i8mm: %s\n", i8mm ? "yes" : "no (path skipped)");
  Reader rd{f};
  int failures = 0;
  try {
    const int64_t cases = rd.i64();
    for (int64_t c = 0; c < cases; ++c) {
      const int64_t bits = rd.i64(), N = rd.i64(), K = rd.i64(), group = rd.i64(), M = rd.i64();
      const int64_t has_mins = rd.i64(), has_bias = rd.i64(), offset = rd.i64(), act_bits = rd.i64();
      const int64_t act_block = rd.i64();  // 16 / 8: sub-block codes in the per-32 layout (not per token)
      const int64_t per_token = act_bits != 0 && act_block == 0;
      const int64_t has_sub = rd.i64();  // group codebooks (gcb): sub-group bytes [tiles, K/32, 16]
      const int64_t pairs = rd.i64();    // 2-D codebooks (vq): K/2 codes per row, x in pair-split order
      const int64_t sub_block = rd.i64();  // K-quants: 16 / 32 features per integer sub-scale, 0 without
      const int64_t tiles = (N + 15) / 16, kb = K / 32, groups = K / group;
      auto utable = rd.read<uint8_t>(kI8MaxTable);
      auto qweight = rd.read<uint8_t>(tiles * (pairs ? kb / 2 : kb) * lut_i8_block_bytes(static_cast<int>(bits)));
      auto scales = rd.read<c10::Half>(tiles * groups * 16);
      auto mins = rd.read<c10::Half>(has_mins ? tiles * groups * 16 : 0);
      auto bias = rd.read<float>(has_bias ? N : 0);
      auto sub = rd.read<uint8_t>(has_sub ? tiles * kb * 16 : 0);
      const int64_t sub_count = sub_block ? tiles * (K / sub_block) * 16 : 0;  // K-quants: [tiles, K/sub_block, 16]
      auto sub_scales = rd.read<int8_t>(sub_count);
      auto sub_mins = rd.read<uint8_t>(has_mins ? sub_count : 0);
      auto x = rd.read<float>(M * K);
      auto xq = rd.read<int8_t>(M * K);
      auto xd = rd.read<float>(M * kb);
      auto xsum = rd.read<int32_t>(M * kb);
      auto half_sum = rd.read<int32_t>(sub_block == 16 ? M * K / 16 : 0);  // q summed over each 16 features
      failures += !quantizer_matches(x, xq, xd, xsum, M, K, act_bits, act_block, c);
      auto gdsum = rd.read<float>(M * groups);
      auto expected = rd.read<float>(M * N);
      LutI8Weights w{qweight.data(), scales.data(), has_mins ? mins.data() : nullptr, has_sub ? sub.data() : nullptr,
                     {}, 0, N, K, group,
                     has_bias ? bias.data() : nullptr, static_cast<int>(bits), pairs != 0};
      std::memcpy(w.utable, utable.data(), kI8MaxTable);
      w.offset = static_cast<int32_t>(offset);
      if (sub_block) {
        w.sub_scales = sub_scales.data();
        w.sub_mins = has_mins ? sub_mins.data() : nullptr;
        w.sub_block = static_cast<int>(sub_block);
      }
      Q8Acts a{xq.data(), xd.data(), xsum.data(), M, K, gdsum.data()};
      std::vector<int32_t> gqsum(M * groups, 0);  // per-token activations: q summed over each group
      for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < kb; ++b) gqsum[m * groups + b / (group / 32)] += xsum[m * kb + b];
      a.per_token = per_token != 0;
      a.group_qsum = gqsum.data();
      if (sub_block == 16) a.half_sum = half_sum.data();
      std::vector<std::pair<const char*, LutI8Fn>> paths = {{"scalar", lut_i8_scalar}, {"neon", lut_i8_neon}};
      if (dotprod) paths.push_back({"dotprod", lut_i8_dotprod});
      for (auto& [name, fn] : paths) {
        const int64_t bad = mismatches(fn, w, a, tiles, N, expected);
        printf("case %lld bits=%lld N=%lld K=%lld group=%lld M=%lld mins=%lld bias=%lld per_token=%lld gcb=%lld "
               "pairs=%lld sub_block=%lld %s: %s\n",
               (long long)c, (long long)bits, (long long)N, (long long)K, (long long)group, (long long)M,
               (long long)has_mins, (long long)has_bias, (long long)per_token, (long long)has_sub, (long long)pairs,
               (long long)sub_block, name,
               bad ? "MISMATCH" : "equal");
        failures += bad != 0;
      }
    }
    const int64_t q4x_cases = rd.i64();
    for (int64_t c = 0; c < q4x_cases; ++c) {
      const int64_t rows = rd.i64(), chunk = rd.i64(), N = rd.i64(), K = rd.i64(), group = rd.i64(), M = rd.i64();
      const int64_t has_bias = rd.i64(), per_token = rd.i64(), toggled = rd.i64();
      const int64_t row_groups = (N + rows - 1) / rows, kb = K / 32, groups = K / group;
      auto table = rd.read<int8_t>(16);
      auto qweight = rd.read<uint8_t>(row_groups * kb * 16 * rows);
      auto scales = rd.read<c10::Half>(row_groups * groups * rows);
      auto bias = rd.read<float>(has_bias ? N : 0);
      auto xq = rd.read<int8_t>(M * K);
      auto xd = rd.read<float>(M * kb);
      auto xsum = rd.read<int32_t>(M * kb);
      auto expected = rd.read<float>(M * N);
      Q4xWeights w{qweight.data(), scales.data(), {}, toggled != 0, static_cast<int>(rows), static_cast<int>(chunk),
                   N, K, group, has_bias ? bias.data() : nullptr};
      std::memcpy(w.table, table.data(), 16);
      Q8Acts a{xq.data(), xd.data(), xsum.data(), M, K, nullptr};
      a.per_token = per_token != 0;
      std::vector<std::pair<const char*, Q4xFn>> paths = {{"scalar", q4x_scalar}};
      if (dotprod && chunk == 4) paths.push_back({"dotprod", q4x_dotprod});
      if (i8mm && chunk == 8) paths.push_back({"i8mm", q4x_i8mm});
      for (auto& [name, fn] : paths) {
        const int64_t bad = mismatches(fn, w, a, row_groups, N, expected);
        printf("q4x case %lld q4_%lldx%lld N=%lld K=%lld group=%lld M=%lld bias=%lld per_token=%lld %s: %s\n",
               (long long)c, (long long)rows, (long long)chunk, (long long)N, (long long)K, (long long)group,
               (long long)M, (long long)has_bias, (long long)per_token, name, bad ? "MISMATCH" : "equal");
        failures += bad != 0;
      }
    }
    const int64_t tcq_cases = rd.i64();
    for (int64_t c = 0; c < tcq_cases; ++c) {
      const int64_t shift = rd.i64(), table_bits = rd.i64(), N = rd.i64(), K = rd.i64(), M = rd.i64();
      const int64_t has_bias = rd.i64(), entries = rd.i64();
      auto table = rd.read<float>(entries * 2);
      auto words = rd.read<uint32_t>((N / 16) * (K / 16) * 4 * shift);
      auto scales = rd.read<c10::Half>(N);
      auto bias = rd.read<float>(has_bias ? N : 0);
      auto x = rd.read<float>(M * K);
      auto expected_w = rd.read<float>(N * K);
      auto expected_y = rd.read<float>(M * N);
      TcqWeights w{words.data(), static_cast<int>(shift), static_cast<int>(table_bits), table.data(), scales.data(),
                   has_bias ? bias.data() : nullptr, N, K};
      const int64_t bands = N / 16;
      std::vector<std::tuple<const char*, TcqDecodeFn, TcqGemvFn>> paths = {
          {"scalar", tcq_decode_scalar, tcq_gemv_scalar}, {"neon", tcq_decode_neon, tcq_gemv_neon}};
      for (auto& [name, decode, gemv] : paths) {
        std::vector<float> wd(N * K, -1.f), y(M * N, -1.f);
        decode(w, 0, bands / 2, wd.data());  // two calls over disjoint bands, as the threads do
        decode(w, bands / 2, bands, wd.data() + (bands / 2) * 16 * K);
        gemv(w, x.data(), M, 0, bands / 2, y.data());
        gemv(w, x.data(), M, bands / 2, bands, y.data());
        const bool decode_ok = std::memcmp(wd.data(), expected_w.data(), 4 * N * K) == 0;
        std::vector<double> bound(M * N, 0.);  // sum |w x'| and the 1mad GEMV's 510-offset terms
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n)
            for (int64_t k = 0; k < K; ++k)
              bound[m * N + n] += std::fabs(x[m * K + k]) *
                                  (std::fabs(expected_w[n * K + k]) + 8.f * static_cast<float>(scales[n]));
        const int64_t bad = gemv_far(y, expected_y, bound, N);
        printf("tcq case %lld s=%lld table_bits=%lld N=%lld K=%lld M=%lld bias=%lld %s: %s\n", (long long)c,
               (long long)shift, (long long)table_bits, (long long)N, (long long)K, (long long)M, (long long)has_bias,
               name, decode_ok && !bad ? "equal" : "MISMATCH");
        failures += !decode_ok || bad;
      }
    }
    const int64_t codebook_cases = rd.i64();
    for (int64_t c = 0; c < codebook_cases; ++c) {
      const int64_t bits = rd.i64(), dim = rd.i64(), N = rd.i64(), K = rd.i64(), M = rd.i64(), has_bias = rd.i64();
      const int64_t entries = int64_t{1} << bits, codes = K / dim;
      const int64_t row_words = kCodeStreams * (((codes + kCodeStreams - 1) / kCodeStreams * bits + 31) / 32);
      auto planes = rd.read<float>(dim * entries);
      auto words = rd.read<uint32_t>(N * row_words);
      auto scales = rd.read<c10::Half>(N);
      auto bias = rd.read<float>(has_bias ? N : 0);
      auto acts = rd.read<float>(dim * M * codes);  // x' split into planes: acts[(c M + m) codes + j] = x'[m, d j + c]
      auto expected_w = rd.read<float>(N * K);
      auto expected_y = rd.read<float>(M * N);
      const CodebookWeights w{words.data(), row_words, static_cast<int>(bits), static_cast<int>(dim), planes.data(),
                              scales.data(), has_bias ? bias.data() : nullptr, N, K};
      std::vector<double> bound(M * N, 0.);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < K; ++k)
            bound[m * N + n] += std::fabs(acts[((k % dim) * M + m) * codes + k / dim] * expected_w[n * K + k]);
      const std::tuple<const char*, CodebookDecodeFn, CodebookGemvFn> paths[] = {
          {"scalar", codebook_decode_scalar, codebook_gemv_scalar}, {"neon", codebook_decode_neon, codebook_gemv_neon}};
      for (auto& [name, decode, gemv] : paths) {
        std::vector<float> wd(N * K, -1.f), y(M * N, -1.f);
        decode(w, 0, N / 2, wd.data());  // two calls over disjoint rows, as the threads do
        decode(w, N / 2, N, wd.data() + (N / 2) * K);
        gemv(w, acts.data(), M, 0, N / 2, y.data());
        gemv(w, acts.data(), M, N / 2, N, y.data());
        const bool decode_ok = std::memcmp(wd.data(), expected_w.data(), 4 * N * K) == 0;
        // the scalar GEMV is the x86 one's arithmetic (bit for bit); NEON sums in another order
        const bool scalar = std::strcmp(name, "scalar") == 0;
        const int64_t bad = scalar ? int64_t{std::memcmp(y.data(), expected_y.data(), 4 * M * N) != 0}
                                   : gemv_far(y, expected_y, bound, N);
        printf("codebook case %lld bits=%lld dim=%lld N=%lld K=%lld M=%lld bias=%lld %s: %s\n", (long long)c,
               (long long)bits, (long long)dim, (long long)N, (long long)K, (long long)M, (long long)has_bias, name,
               decode_ok && !bad ? "equal" : "MISMATCH");
        failures += !decode_ok || bad;
      }
    }
    const int64_t hadamard_cases = rd.i64();
    for (int64_t c = 0; c < hadamard_cases; ++c) {
      const int64_t k = rd.i64(), len = rd.i64();
      auto x = rd.read<float>(k * len);
      auto mix = rd.read<float>(k * k);
      auto expected = rd.read<float>(k * len);
      std::vector<float> scalar = x, neon = x, scalar_mixed(k * len, -1.f), neon_mixed(k * len, -2.f);
      fwht_scalar(scalar.data(), k, len);
      fwht_neon(neon.data(), k, len);
      bool equal = std::memcmp(scalar.data(), neon.data(), 4 * k * len) == 0;
      const float* result = scalar.data();
      if (k > 1) {
        block_mix_scalar(mix.data(), k, scalar.data(), scalar_mixed.data(), len);
        block_mix_neon(mix.data(), k, neon.data(), neon_mixed.data(), len);
        equal = equal && std::memcmp(scalar_mixed.data(), neon_mixed.data(), 4 * k * len) == 0;
        result = scalar_mixed.data();
      }
      double bound = 0;  // fp32 sums of k * len terms of |x|: within 1e-6 * log2(k len) of the float64 transform
      for (float v : x) bound += std::fabs(v);
      bool close = true;
      for (int64_t i = 0; i < k * len; ++i) close = close && std::fabs(result[i] - expected[i]) <= 1e-6 * bound + 1e-6;
      printf("hadamard case %lld k=%lld len=%lld: %s\n", (long long)c, (long long)k, (long long)len,
             equal && close ? "equal" : (equal ? "SCALAR FAR FROM FLOAT64" : "MISMATCH"));
      failures += !(equal && close);
    }
    const int64_t kv_cases = rd.i64();
    for (int64_t c = 0; c < kv_cases; ++c) {
      const int64_t bits = rd.i64(), D = rd.i64(), group = rd.i64(), G = rd.i64(), rows = rd.i64(), L = rd.i64();
      const int64_t has_mask = rd.i64(), R = rd.i64(), recent_hi = rd.i64();
      const int64_t width = D * bits / 8, groups = D / group;
      auto k_codes = rd.read<uint8_t>(L * width);
      auto v_codes = rd.read<uint8_t>(L * width);
      auto k_scale = rd.read<uint16_t>(L * groups);
      auto k_min = rd.read<uint16_t>(L * groups);
      auto v_scale = rd.read<uint16_t>(L * groups);
      auto v_min = rd.read<uint16_t>(L * groups);
      auto q = rd.read<float>(rows * G * D);
      auto mask = rd.read<float>(rows * L);
      auto k_ring = rd.read<float>(std::max<int64_t>(R, 1) * D);
      auto v_ring = rd.read<float>(std::max<int64_t>(R, 1) * D);
      auto expected = rd.read<float>(rows * G * D);
      const std::pair<const char*, void (*)(const KvAttentionTask&)> paths[] = {{"scalar", kv_attention_task_scalar},
                                                                                {"neon", kv_attention_task_neon}};
      for (auto& [name, task_fn] : paths) {
        std::vector<float> out(rows * G * D, -7.f), scratch(kv_attention_scratch_floats(rows * G, L, D));
        KvAttentionTask t;  // one task: every row of the block x the G heads of one KV head
        t.q = q.data();
        t.q_stride = D;
        t.rows = rows;
        t.q_row_stride = G * D;
        t.out_row_stride = G * D;
        t.mask_row_stride = L;
        t.k_codes = k_codes.data();
        t.k_scale = k_scale.data();
        t.k_min = k_min.data();
        t.v_codes = v_codes.data();
        t.v_scale = v_scale.data();
        t.v_min = v_min.data();
        t.mask = has_mask ? mask.data() : nullptr;
        t.mask_head_stride = 0;
        t.mask_key_stride = 1;
        t.out = out.data();
        t.out_stride = D;
        t.G = G;
        t.L = L;
        t.D = D;
        t.group = group;
        t.bits = static_cast<int>(bits);
        t.scale = 1.f / std::sqrt(static_cast<float>(D));
        t.scores = scratch.data();
        t.row = scratch.data() + scratch.size() - kKvScratchRows * D;
        if (R) {
          t.k_recent = k_ring.data();
          t.v_recent = v_ring.data();
          t.recent_len = R;
          t.recent_hi = recent_hi;
          t.recent_lo = std::max<int64_t>(recent_hi - R, 0);
        }
        task_fn(t);
        int64_t bad = 0;
        for (int64_t i = 0; i < rows * G * D; ++i) {
          const float got = out[i], want = expected[i];
          const bool ok = std::isnan(want) ? std::isnan(got) : std::fabs(got - want) <= 2e-5f + 2e-5f * std::fabs(want);
          if (!ok && bad++ == 0) printf("  first difference at %lld: %.9g vs %.9g\n", (long long)i, got, want);
        }
        printf("kv case %lld bits=%lld D=%lld group=%lld G=%lld rows=%lld L=%lld mask=%lld R=%lld %s: %s\n",
               (long long)c, (long long)bits, (long long)D, (long long)group, (long long)G, (long long)rows,
               (long long)L, (long long)has_mask, (long long)R, name, bad ? "MISMATCH" : "close");
        failures += bad != 0;
      }
    }
  } catch (const std::string& e) {
    fprintf(stderr, "%s\n", e.c_str());
    return 2;
  }
  printf(failures ? "FAILED\n" : "ALL EQUAL\n");
  return failures ? 1 : 0;
}
