// Many tokens through a decode-only kernel: decode `unit`-aligned row chunks to fp32 (threaded) and
// multiply each with at::mm, so the decode is amortized over the tokens (palette and gvq ops).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>

#include "common/parallel.h"
#include "common/scratch.h"

namespace torch_lowbit {

constexpr int64_t kDecodeChunkRows = 256;  // rows decoded per at::mm

struct DecodeChunk;  // thread_scratch tag

// out [M, N] = x2 [M, K] @ W^T, decode(r0, r1, dst) writing rows [r0, r1) (in units) of W into dst.
template <typename Decode>
at::Tensor decode_matmul(const at::Tensor& x2, int64_t N, int64_t K, int64_t unit, Decode decode) {
  at::Tensor out = at::empty({x2.size(0), N}, x2.options());
  // The chunk buffer (4 MiB: 256 rows at K = 4096) lives on between calls (scratch.h)
  const int64_t chunk = std::min(N, kDecodeChunkRows);
  float* storage = reinterpret_cast<float*>(thread_scratch<DecodeChunk>(chunk * K * sizeof(float)));
  at::Tensor buf = at::from_blob(storage, {chunk, K}, x2.options());
  for (int64_t r0 = 0; r0 < N; r0 += kDecodeChunkRows) {
    const int64_t rows = std::min(kDecodeChunkRows, N - r0);
    float* dst = buf.data_ptr<float>();
    parallel_for(0, rows / unit, 1, [&](int64_t u0, int64_t u1) {
      decode(r0 / unit + u0, r0 / unit + u1, dst + u0 * unit * K);
    });
    out.narrow(1, r0, rows).copy_(at::mm(x2, buf.narrow(0, 0, rows).t()));
  }
  return out;
}

}  // namespace torch_lowbit
