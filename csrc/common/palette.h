// Fused decode-matmul kernels of the Q-Palette formats on the CPU (layout palette_packed, see
// torch_lowbit/layouts/palette_packed.py): fp32 activations (already rotated, x' = (x * s) @ H) times
// the codes decoded in registers, one fp16 scale per output row. The formats' math lives in
// torch_lowbit/formats (gaussian.py, tcq.py); the inline decoders below are its C++ transcription,
// which every kernel path must match (tests compare each path with the Python reference decoder).
//
// Codebook formats (nuq: 1-D table, vq: 2-D table): code j of a row stands for weights
// [d j, d j + d). A row's codes are dealt round-robin to 16 bit streams (code j -> stream j % 16,
// position j / 16), each MSB-first in uint32 words, word w of stream l at row word 16 w + l: the
// 16 codes 16 v .. 16 v + 15 then sit at the same bit offset of 16 adjacent words, so a vector
// kernel cuts them out of one or two aligned loads with uniform shifts.
//
// TCQ: one sequence of 4 * s words per 16 x 16 tile (row-major inside the tile); step t's 16-bit
// state is the stream's window at bit t * s (wrapping: tail-biting). Its 2-D value comes from QTIP's
// hybrid code: h = state * (state + 1) mod 2^16, entry (h >> (15 - Q)) mod 2^Q of the 2^Q x 2 table,
// first coordinate negated when bit 15 of h is set (kernels read the signed table: tcq_signed_table).
// Or (table_bits == kTcqMadTableBits, no table) the computed 1mad code: coordinate c of the value is
// (bytesum((A_c state + B_c) mod 2^32) - 510) / 128 (tcq_mad_coordinate).
#pragma once
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/token_blocks.h"

namespace torch_lowbit {

// Up to this many tokens the fused kernels run (weights decoded once per token block); above it the
// op decodes row chunks to fp32 and hands them to at::mm (decode cost amortized over M). The fused
// GEMVs re-decode per block of tokens but write nothing: at 4096^2 on Zen 4 (2 threads) they beat the
// decode route up to ~24-30 tokens (M = 16: tcq2_1mad 7.4-8.0 vs 10.5 ms, vq3 6.0 vs 9.8 ms; M = 24:
// vq3 8.9 vs 11.3), so the crossover sits at 24.
constexpr int64_t kPaletteFusedMaxTokens = 24;
constexpr int kTcqTile = 16;

constexpr int kCodeStreams = 16;

// Words are MSB-first bit streams stored little-endian: stream byte k is memory byte k ^ 3.
inline int stream_memory_byte(int k) { return k ^ 3; }

// The b-bit code j of a row in the 16-stream layout above (b <= 25, so two words always suffice).
inline uint32_t stream_code(const uint32_t* row, int64_t j, int bits) {
  const int64_t lane = j % kCodeStreams, pos = (j / kCodeStreams) * bits;
  const int64_t w = pos >> 5;
  const int o = static_cast<int>(pos & 31);
  uint32_t v = row[w * kCodeStreams + lane] << o;
  if (o + bits > 32) v |= row[(w + 1) * kCodeStreams + lane] >> (32 - o);
  return v >> (32 - bits);
}

// The 16-bit state of step t of a TCQ sequence (`count` words, read cyclically).
inline uint32_t tcq_state(const uint32_t* seq, int count, int t, int shift) {
  const int pos = t * shift, w = pos >> 5, o = pos & 31;
  uint32_t v = seq[w] << o;
  if (o) v |= seq[(w + 1) % count] >> (32 - o);
  return v >> 16;
}

// TCQ's computed 1mad code (torch_lowbit/core/tcq_codes.py: MAD_* constants, which tests pin these to).
constexpr int kTcqMadTableBits = 0;
constexpr uint32_t kTcqMadMultipliers[2] = {34038481u, 3188803409u};
constexpr uint32_t kTcqMadIncrements[2] = {76625530u, 1013904223u};
constexpr int kTcqMadOffset = 510;
constexpr float kTcqMadUnit = 1.f / 128;

// The sum of the four bytes of (A_c state + B_c) mod 2^32 (0 .. 1020).
inline int tcq_mad_bytesum(uint32_t state, int c) {
  const uint32_t z = kTcqMadMultipliers[c] * state + kTcqMadIncrements[c];
  return static_cast<int>((z & 0xFF) + ((z >> 8) & 0xFF) + ((z >> 16) & 0xFF) + (z >> 24));
}

inline float tcq_mad_coordinate(uint32_t state, int c) {
  return static_cast<float>(tcq_mad_bytesum(state, c) - kTcqMadOffset) * kTcqMadUnit;  // exact
}

// state -> (x, y). The hybrid code reads the signed table [2^(Q+1), 2] (interleaved): entries
// 2^Q + e are entries e with x negated, so bit 15 of h (the sign) is just the index's top bit.
inline void tcq_value(const float* signed_table, int table_bits, uint32_t state, float& x, float& y) {
  if (table_bits == kTcqMadTableBits) {
    x = tcq_mad_coordinate(state, 0);
    y = tcq_mad_coordinate(state, 1);
    return;
  }
  const uint32_t h = (state * (state + 1)) & 0xFFFF;
  const uint32_t idx = (h >> (15 - table_bits)) & ((2u << table_bits) - 1);
  x = signed_table[2 * idx];
  y = signed_table[2 * idx + 1];
}

// The 1mad GEMVs' order of x': per 16-column tile, its 8 even columns, then its 8 odd ones (a tile
// row's first coordinates, then its second ones); sums[m] = the sum of token m's x' (the vector
// kernels subtract the byte sums' offset once per row: sum_k x'_k (S_k - 510) = sum_k x'_k S_k - 510 sum_k x'_k).
inline void tcq_split_columns(const float* x, int64_t M, int64_t K, float* split, float* sums) {
  for (int64_t m = 0; m < M; ++m) {
    double total = 0;
    for (int64_t k0 = 0; k0 < K; k0 += kTcqTile)
      for (int j = 0; j < kTcqTile / 2; ++j) {
        const float even = x[m * K + k0 + 2 * j], odd = x[m * K + k0 + 2 * j + 1];
        split[m * K + k0 + j] = even;
        split[m * K + k0 + kTcqTile / 2 + j] = odd;
        total += static_cast<double>(even) + odd;
      }
    sums[m] = static_cast<float>(total);
  }
}

struct CodebookWeights {
  const uint32_t* words;  // [N, row_words]
  int64_t row_words;      // 16 * words per stream
  int code_bits;          // b, 1..12
  int dim;                // d, 1 or 2 weights per code
  const float* planes;    // [d, 2^b]: coordinate c of entry e at planes[c * 2^b + e]
  const c10::Half* scales;  // [N]
  const float* bias;      // [N] or nullptr
  int64_t N, K;
};

struct TcqWeights {
  const uint32_t* words;  // [N / 16, K / 16, 4 * shift]
  int shift;              // s = 2 * bits, 3..10
  int table_bits;         // Q; kTcqMadTableBits: the computed 1mad code
  const float* table;     // signed table [2^(Q+1), 2] interleaved (see tcq_value); unused by 1mad
  const c10::Half* scales;  // [N]
  const float* bias;      // [N] or nullptr
  int64_t N, K;
};

// The TCQ GEMV's band loop, shared by the vector paths: the 1mad code reads x' in split-column order
// with each token's sum (tcq_split_columns), the table code reads x as it is. Calls
// band(TokenCount<T>, std::bool_constant<mad>, x', sums or nullptr, m0, band index).
template <int MaxTokens, typename Band>
void tcq_gemv_bands(const TcqWeights& w, const float* x, int64_t M, int64_t b0, int64_t b1, Band&& band) {
  const bool mad = w.table_bits == kTcqMadTableBits;
  std::vector<float> split(mad ? M * w.K : 0), sums(mad ? M : 0);
  if (mad) tcq_split_columns(x, M, w.K, split.data(), sums.data());
  for (int64_t b = b0; b < b1; ++b)
    for_token_blocks<MaxTokens>(M, [&](auto T, int64_t m0) {
      if (mad) band(T, std::true_type{}, split.data(), sums.data(), m0, b);
      else band(T, std::false_type{}, x, static_cast<const float*>(nullptr), m0, b);
    });
}

// y[m, n] = scale[n] * <decoded row n, x'[m]> + bias[n] for rows [n0, n1) and any M (the op runs them
// up to kPaletteFusedMaxTokens tokens). Codebook kernels read x' split into d planes:
// acts[(c * M + m) * (K / d) + j] = x'[m, d j + c].
using CodebookGemvFn = void (*)(const CodebookWeights&, const float* acts, int64_t M, int64_t n0, int64_t n1,
                                float* out);
// Rows [n0, n1) decoded and scaled (scale[n] * value) into dst [(n1 - n0), K].
using CodebookDecodeFn = void (*)(const CodebookWeights&, int64_t n0, int64_t n1, float* dst);
// TCQ: the same over 16-row bands [b0, b1); x' is [M, K] row-major.
using TcqGemvFn = void (*)(const TcqWeights&, const float* x, int64_t M, int64_t b0, int64_t b1, float* out);
using TcqDecodeFn = void (*)(const TcqWeights&, int64_t b0, int64_t b1, float* dst);

void codebook_gemv_scalar(const CodebookWeights&, const float*, int64_t, int64_t, int64_t, float*);
void codebook_decode_scalar(const CodebookWeights&, int64_t, int64_t, float*);
void tcq_gemv_scalar(const TcqWeights&, const float*, int64_t, int64_t, int64_t, float*);
void tcq_decode_scalar(const TcqWeights&, int64_t, int64_t, float*);
#if defined(TORCH_LOWBIT_X86)
void codebook_gemv_avx512(const CodebookWeights&, const float*, int64_t, int64_t, int64_t, float*);
void codebook_decode_avx512(const CodebookWeights&, int64_t, int64_t, float*);
void tcq_decode_avx512(const TcqWeights&, int64_t, int64_t, float*);
void codebook_gemv_avx2(const CodebookWeights&, const float*, int64_t, int64_t, int64_t, float*);
void codebook_decode_avx2(const CodebookWeights&, int64_t, int64_t, float*);
void tcq_gemv_avx2(const TcqWeights&, const float*, int64_t, int64_t, int64_t, float*);
void tcq_decode_avx2(const TcqWeights&, int64_t, int64_t, float*);
// the AVX2 TCQ GEMV with vpdpbusd byte sums: VEX (AVX-VNNI) and EVEX (AVX512-VNNI + VL) encoded
void tcq_gemv_avxvnni(const TcqWeights&, const float*, int64_t, int64_t, int64_t, float*);
void tcq_gemv_avxvnni_evex(const TcqWeights&, const float*, int64_t, int64_t, int64_t, float*);
#endif
#if defined(__aarch64__)
void codebook_gemv_neon(const CodebookWeights&, const float*, int64_t, int64_t, int64_t, float*);
void codebook_decode_neon(const CodebookWeights&, int64_t, int64_t, float*);
// both TCQ codes: the 1mad code computed in vectors, the hybrid code's entries read with per-lane loads
void tcq_gemv_neon(const TcqWeights&, const float*, int64_t, int64_t, int64_t, float*);
void tcq_decode_neon(const TcqWeights&, int64_t, int64_t, float*);
#endif

}  // namespace torch_lowbit
