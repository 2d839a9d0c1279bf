// Portable scalar paths of the palette kernels: the plain reading of palette.h that the vector
// paths are checked against.
#include <algorithm>
#include <vector>

#include "common/palette.h"

namespace torch_lowbit {

namespace {

// Decoded and scaled row n (codebook formats) into dst[K].
void codebook_row(const CodebookWeights& w, int64_t n, float* dst) {
  const uint32_t* words = w.words + n * w.row_words;
  const int64_t entries = int64_t{1} << w.code_bits, codes = w.K / w.dim;
  const float scale = static_cast<float>(w.scales[n]);
  for (int64_t j = 0; j < codes; ++j) {
    const uint32_t code = stream_code(words, j, w.code_bits);
    for (int c = 0; c < w.dim; ++c) dst[j * w.dim + c] = w.planes[c * entries + code] * scale;
  }
}

// Decoded (unscaled) 16 x 16 tile `tile` of band b into tile_out[16][16].
void tcq_tile(const TcqWeights& w, int64_t b, int64_t tile, float* tile_out) {
  const int count = 4 * w.shift;
  const uint32_t* seq = w.words + (b * (w.K / kTcqTile) + tile) * count;
  for (int t = 0; t < kTcqTile * kTcqTile / 2; ++t)
    tcq_value(w.table, w.table_bits, tcq_state(seq, count, t, w.shift), tile_out[2 * t], tile_out[2 * t + 1]);
}

float finish(float dot, const c10::Half* scales, const float* bias, int64_t n) {
  return dot * static_cast<float>(scales[n]) + (bias ? bias[n] : 0.f);
}

}  // namespace

void codebook_gemv_scalar(const CodebookWeights& w, const float* acts, int64_t M, int64_t n0, int64_t n1,
                          float* out) {
  const int64_t entries = int64_t{1} << w.code_bits, codes = w.K / w.dim;
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* words = w.words + n * w.row_words;
    for (int64_t m = 0; m < M; ++m) {
      float dot = 0.f;
      for (int64_t j = 0; j < codes; ++j) {
        const uint32_t code = stream_code(words, j, w.code_bits);
        for (int c = 0; c < w.dim; ++c) dot += w.planes[c * entries + code] * acts[(c * M + m) * codes + j];
      }
      out[m * w.N + n] = finish(dot, w.scales, w.bias, n);
    }
  }
}

void codebook_decode_scalar(const CodebookWeights& w, int64_t n0, int64_t n1, float* dst) {
  for (int64_t n = n0; n < n1; ++n) codebook_row(w, n, dst + (n - n0) * w.K);
}

void tcq_gemv_scalar(const TcqWeights& w, const float* x, int64_t M, int64_t b0, int64_t b1, float* out) {
  const int64_t tiles = w.K / kTcqTile;
  float tile[kTcqTile * kTcqTile];
  std::vector<float> dots(M * kTcqTile);
  for (int64_t b = b0; b < b1; ++b) {
    std::fill(dots.begin(), dots.end(), 0.f);
    for (int64_t t = 0; t < tiles; ++t) {
      tcq_tile(w, b, t, tile);
      for (int64_t m = 0; m < M; ++m)
        for (int r = 0; r < kTcqTile; ++r)
          for (int c = 0; c < kTcqTile; ++c) dots[m * kTcqTile + r] += tile[r * kTcqTile + c] * x[m * w.K + t * kTcqTile + c];
    }
    for (int64_t m = 0; m < M; ++m)
      for (int r = 0; r < kTcqTile; ++r) {
        const int64_t n = b * kTcqTile + r;
        out[m * w.N + n] = finish(dots[m * kTcqTile + r], w.scales, w.bias, n);
      }
  }
}

void tcq_decode_scalar(const TcqWeights& w, int64_t b0, int64_t b1, float* dst) {
  const int64_t tiles = w.K / kTcqTile;
  float tile[kTcqTile * kTcqTile];
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t t = 0; t < tiles; ++t) {
      tcq_tile(w, b, t, tile);
      for (int r = 0; r < kTcqTile; ++r) {
        const int64_t n = b * kTcqTile + r;
        const float scale = static_cast<float>(w.scales[n]);
        float* row = dst + (n - b0 * kTcqTile) * w.K + t * kTcqTile;
        for (int c = 0; c < kTcqTile; ++c) row[c] = tile[r * kTcqTile + c] * scale;
      }
    }
}

}  // namespace torch_lowbit
