// The general VQ kernels on the CPU (layout gvq_rowmajor, torch_lowbit/layouts/gvq.py): y = x W'^T
// with W'[n, vec j .. vec j + vec) = scale[n] * sum_r codebook[region(n, j)][r][code(n, j, r)].
//
// Codes are bit fields (LSB first) of `bits` bits, field f = j * stages + r of a row. The fields are
// cut into chunks of chunk_fields (gvq_chunk_fields: a multiple of 8, so every full chunk is whole
// bytes) and stored chunk-major: chunk c holds every row's bytes of its fields, row after row. The
// codebooks arrive as planes [regions, stages, vec, entries] fp16 (coordinate d of every entry
// contiguous), region = row tile * column tiles + column tile (tile sizes 0: the whole dimension).
//
// The GEMV is codebook-centric (VQ-LLM): for a chunk of fields the kernel first *loads* a table of
// every entry's dot product with the token's activations, lut[f][e] = <codebook[region][r][e], x_j>
// (E floats per field, chunk_fields chosen so a chunk's tables fit in L1), then *accesses* it once per
// row and field (a gather of 8 / 16 fields' entries per instruction), and *switches* to the next
// chunk. A row's dot product is then the sum of its fields' table entries: one lookup per code
// instead of vec multiply-adds, and the tables are shared by every row of the region. The threads
// split the chunks (the axis that shares a table) and their partial sums are reduced.
#pragma once
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace torch_lowbit {

// Up to this many tokens the fused table kernels run; above, row chunks are decoded to fp32 for at::mm.
constexpr int64_t kGvqFusedMaxTokens = 8;

// Fields per chunk for a codebook of `entries` entries: 16 KiB of fp32 tables per token, 8 .. 64
// fields (torch_lowbit/layouts/gvq.py chunk_fields computes the same).
inline int64_t gvq_chunk_fields(int64_t entries) {
  const int64_t f = (4096 / entries) / 8 * 8;
  return std::min<int64_t>(64, std::max<int64_t>(8, f));
}

struct GvqWeights {
  const uint8_t* codes;  // chunk-major bit fields (above)
  int bits;              // y, 4 .. 16
  int vec, stages;
  int64_t entries;           // 2^bits
  const c10::Half* planes;   // [regions, stages, vec, entries]
  int64_t tile_rows, tile_cols, col_tiles;  // tile sizes 0: all rows / all features
  const c10::Half* scales;   // [N]
  int64_t N, K;
  int64_t fields, chunk_fields, chunks;

  int64_t chunk_width(int64_t c) const { return std::min(chunk_fields, fields - c * chunk_fields); }
  int64_t chunk_row_bytes(int64_t c) const { return (chunk_width(c) * bits + 7) / 8; }
  const uint8_t* chunk_codes(int64_t c) const { return codes + c * N * (chunk_fields * bits / 8); }
  int64_t row_tiles() const { return tile_rows ? (N + tile_rows - 1) / tile_rows : 1; }
  int64_t regions() const { return row_tiles() * col_tiles; }
  int64_t region(int64_t row_tile, int64_t field) const {
    const int64_t j = field / stages;
    return row_tile * col_tiles + (tile_cols ? j * vec / tile_cols : 0);
  }
  const c10::Half* plane(int64_t region, int64_t field) const {
    return planes + (region * stages + field % stages) * vec * entries;
  }
};

// Field i of a row's bit fields (bits <= 16: at most 3 bytes), never reading past row_bytes.
inline uint32_t gvq_field(const uint8_t* row, int64_t i, int bits, int64_t row_bytes) {
  const int64_t bit = i * bits, byte = bit >> 3;
  uint32_t v = 0;
  for (int b = 0; b < 3 && byte + b < row_bytes; ++b) v |= static_cast<uint32_t>(row[byte + b]) << (8 * b);
  return (v >> (bit & 7)) & ((1u << bits) - 1);
}

// The loop every table GEMV runs over its chunks [c0, c1): per chunk and row tile, tables(c, rt) builds
// the tables, then rows(c, r0, r1) looks rows [r0, r1) up in them.
template <typename Tables, typename Rows>
inline void gvq_for_chunks(const GvqWeights& w, int64_t c0, int64_t c1, Tables&& tables, Rows&& rows) {
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t rt = 0; rt < w.row_tiles(); ++rt) {
      tables(c, rt);
      const int64_t r0 = w.tile_rows ? rt * w.tile_rows : 0;
      rows(c, r0, w.tile_rows ? std::min(w.N, r0 + w.tile_rows) : w.N);
    }
}

// acc[m * N + n] += sum over the fields of chunks [c0, c1) of row n's table entries for token m (no
// scale): every row, the chunk range one thread's share. x is [M, K] fp32.
using GvqGemvFn = void (*)(const GvqWeights&, const float* x, int64_t M, int64_t c0, int64_t c1, float* acc);
// Rows [n0, n1) decoded and scaled into dst [(n1 - n0), K] (the same values as the reference decoder).
using GvqDecodeFn = void (*)(const GvqWeights&, int64_t n0, int64_t n1, float* dst);

// The tables of chunk c for row tile rt and token x: lut[(f - first field) * E + e] =
// ((P0[e] x0 + P1[e] x1) + ...) in separate fp32 multiplies and adds, so every path builds the same bits.
void gvq_build_tables_scalar(const GvqWeights& w, const float* x, int64_t c, int64_t rt, float* lut);

// The ablation's kernels (gvq_kernel_variant): "direct" reads every code's entry from the whole
// codebook (fp32 entries [regions, stages, E, vec], L1/L2-resident) and multiplies it with x, rows
// [n0, n1) into acc (the shared-memory "SC" kernel of VQ-LLM); "decode" dequantizes rows to fp32 in
// memory and multiplies with at::mm (element-wise dequantization, the "GC" kernel); "tables" (the
// default) is the table GEMV above.
enum class GvqVariant { Tables = 0, Direct = 1, Decode = 2 };
GvqVariant gvq_kernel_variant();
void set_gvq_kernel_variant(const std::string& name);
using GvqDirectFn = void (*)(const GvqWeights&, const float* entries, const int32_t* field_base, const float* x,
                             int64_t M, int64_t n0, int64_t n1, float* acc);
// field_base[rt * fields + f] = ((region(rt, f) * stages + f % stages) * E) * vec: where field f's entries start
void gvq_direct_scalar(const GvqWeights&, const float*, const int32_t*, const float*, int64_t, int64_t, int64_t, float*);

void gvq_gemv_scalar(const GvqWeights&, const float*, int64_t, int64_t, int64_t, float*);
void gvq_decode_scalar(const GvqWeights&, int64_t, int64_t, float*);
#if defined(TORCH_LOWBIT_X86)
void gvq_gemv_avx2(const GvqWeights&, const float*, int64_t, int64_t, int64_t, float*);
void gvq_direct_avx2(const GvqWeights&, const float*, const int32_t*, const float*, int64_t, int64_t, int64_t, float*);
void gvq_gemv_avx512(const GvqWeights&, const float*, int64_t, int64_t, int64_t, float*);
void gvq_direct_avx512(const GvqWeights&, const float*, const int32_t*, const float*, int64_t, int64_t, int64_t, float*);
#endif

}  // namespace torch_lowbit
