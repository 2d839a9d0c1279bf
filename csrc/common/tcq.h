// Trellis-coded quantization (TCQ) encoder kernels: one step of the Viterbi over QTIP's bitshift
// trellis (torch_lowbit/formats/tcq.py holds the math and the bit layout).
//
// A state p is 16 bits; a step shifts s new bits in at the bottom. State p = k * G + g (G = 2^(16-s))
// is reached from the group of states whose low 16-s bits equal p >> s, and itself belongs to the
// predecessor group g of its successors. So one step maps the best cost per group to the next:
//   next[g] = min_k cost(p),  p = k * G + g,  k < 2^s
//   cost(p) = fma(ay, cy[p], fma(ax, cx[p], prev[p >> s] + c2[p]))
// with ax = -2 x0, ay = -2 x1, c2 = cx^2 + cy^2 (so cost - prev = |x - c|^2 - |x|^2). That order
// needs no register copies in the vector loop (the add makes a fresh register the FMAs overwrite).
// Every path must round exactly like this: the traceback recomputes costs and looks for the k whose
// cost equals next[g], instead of storing a backpointer per group.
#pragma once
#include <cmath>
#include <cstdint>

namespace torch_lowbit {

constexpr int kTcqStateBits = 16;
constexpr int kTcqStates = 1 << kTcqStateBits;
constexpr int kTcqSteps = 128;      // 256 weights, 2 per step
constexpr int kTcqMaxBatch = 8;     // sequences advanced together (they share the table reads)
constexpr int kTcqGroupPad = 16;    // floats after each cost array that vector loads may touch

struct TcqCode {
  const float* cx;  // [2^16] state values, first coordinate, by state
  const float* cy;  // [2^16] second coordinate
  const float* c2;  // [2^16] cx^2 + cy^2
  // The same three arrays in visiting order of a 16-group-wide step, 64-byte aligned: entry
  // g0 * 2^s + 16 k + j holds state k * G + g0 + j (g0 a multiple of 16, j < 16), so the walk over
  // the 2^s predecessors of 16 groups reads memory sequentially instead of with a 4*G-byte stride.
  const float* cx_blocked;
  const float* cy_blocked;
  const float* c2_blocked;
  int shift;  // s, 3..10
};

// One step for `batch` <= kTcqMaxBatch sequences: next[i][g] from prev[i][*] and the step's target
// (x0, x1) given as ax[i] = -2 x0, ay[i] = -2 x1. prev/next hold 2^(16-s) floats (+ kTcqGroupPad).
using TcqStepFn = void (*)(const TcqCode& code, int batch, const float* const* prev, const float* ax,
                           const float* ay, float* const* next);

// The cost of reaching state p, given the best cost `from` of its predecessor group (see above).
inline float tcq_state_cost(float from, float ax, float ay, float cx, float cy, float c2) {
  return std::fma(ay, cy, std::fma(ax, cx, from + c2));
}

void tcq_step_scalar(const TcqCode&, int, const float* const*, const float*, const float*, float* const*);
#if defined(TORCH_LOWBIT_X86)
void tcq_step_avx512(const TcqCode&, int, const float* const*, const float*, const float*, float* const*);
void tcq_step_avx2(const TcqCode&, int, const float* const*, const float*, const float*, float* const*);
#endif

}  // namespace torch_lowbit
