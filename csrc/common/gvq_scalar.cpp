// Portable paths of the general VQ kernels (gvq.h): the table GEMV with scalar lookups and the decode.
#include <vector>

#include "common/gvq.h"
#include "common/scratch.h"

namespace torch_lowbit {

struct GvqScalarTables;  // thread_scratch tag

void gvq_build_tables_scalar(const GvqWeights& w, const float* x, int64_t c, int64_t rt, float* lut) {
  const int64_t f0 = c * w.chunk_fields, width = w.chunk_width(c), E = w.entries;
  for (int64_t i = 0; i < width; ++i) {
    const int64_t f = f0 + i;
    const c10::Half* p = w.plane(w.region(rt, f), f);
    const float* xj = x + (f / w.stages) * w.vec;
    float* t = lut + i * E;
    for (int64_t e = 0; e < E; ++e) t[e] = static_cast<float>(p[e]) * xj[0];
    for (int d = 1; d < w.vec; ++d)
      for (int64_t e = 0; e < E; ++e) t[e] = t[e] + static_cast<float>(p[d * E + e]) * xj[d];
  }
}

void gvq_gemv_scalar(const GvqWeights& w, const float* x, int64_t M, int64_t c0, int64_t c1, float* acc) {
  const int64_t E = w.entries, per_token = w.chunk_fields * E;
  float* lut = reinterpret_cast<float*>(thread_scratch<GvqScalarTables>(M * per_token * sizeof(float)));
  gvq_for_chunks(
      w, c0, c1,
      [&](int64_t c, int64_t rt) {
        for (int64_t m = 0; m < M; ++m) gvq_build_tables_scalar(w, x + m * w.K, c, rt, lut + m * per_token);
      },
      [&](int64_t c, int64_t r0, int64_t r1) {
        const int64_t width = w.chunk_width(c), rb = w.chunk_row_bytes(c);
        for (int64_t n = r0; n < r1; ++n) {
          const uint8_t* row = w.chunk_codes(c) + n * rb;
          for (int64_t m = 0; m < M; ++m) {
            const float* t = lut + m * per_token;
            float s = 0.f;
            for (int64_t i = 0; i < width; ++i) s += t[i * E + gvq_field(row, i, w.bits, rb)];
            acc[m * w.N + n] += s;
          }
        }
      });
}

void gvq_direct_scalar(const GvqWeights& w, const float* entries, const int32_t* field_base, const float* x,
                       int64_t M, int64_t n0, int64_t n1, float* acc) {
  for (int64_t n = n0; n < n1; ++n) {
    const int32_t* base = field_base + (w.tile_rows ? n / w.tile_rows : 0) * w.fields;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * w.K;
      float s = 0.f;
      for (int64_t c = 0; c < w.chunks; ++c) {
        const int64_t rb = w.chunk_row_bytes(c), f0 = c * w.chunk_fields;
        const uint8_t* row = w.chunk_codes(c) + n * rb;
        for (int64_t i = 0; i < w.chunk_width(c); ++i) {
          const int64_t f = f0 + i;
          const float* e = entries + base[f] + gvq_field(row, i, w.bits, rb) * w.vec;
          const float* xj = xm + (f / w.stages) * w.vec;
          for (int d = 0; d < w.vec; ++d) s += e[d] * xj[d];
        }
      }
      acc[m * w.N + n] += s;
    }
  }
}

void gvq_decode_scalar(const GvqWeights& w, int64_t n0, int64_t n1, float* dst) {
  const int64_t E = w.entries;
  for (int64_t n = n0; n < n1; ++n) {
    float* out = dst + (n - n0) * w.K;
    const int64_t rt = w.tile_rows ? n / w.tile_rows : 0;
    for (int64_t c = 0; c < w.chunks; ++c) {
      const int64_t rb = w.chunk_row_bytes(c), f0 = c * w.chunk_fields;
      const uint8_t* row = w.chunk_codes(c) + n * rb;
      for (int64_t i = 0; i < w.chunk_width(c); ++i) {
        const int64_t f = f0 + i, j = f / w.stages;
        const c10::Half* p = w.plane(w.region(rt, f), f) + gvq_field(row, i, w.bits, rb);
        float* o = out + j * w.vec;
        if (f % w.stages == 0) {
          for (int d = 0; d < w.vec; ++d) o[d] = static_cast<float>(p[d * E]);
        } else {
          for (int d = 0; d < w.vec; ++d) o[d] = o[d] + static_cast<float>(p[d * E]);
        }
      }
    }
    const float s = static_cast<float>(w.scales[n]);
    for (int64_t k = 0; k < w.K; ++k) out[k] = out[k] * s;
  }
}

}  // namespace torch_lowbit
