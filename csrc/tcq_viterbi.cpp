// torch_lowbit::tcq_viterbi on CPU: the tail-biting Viterbi encoder of TCQ sequences (QTIP's
// bitshift trellis, L = 16, 2 weights per step, 256 weights per sequence). The math and the bit
// layout are defined in torch_lowbit/formats/tcq.py; this file must produce the same state paths
// as its reference Viterbi (up to fp rounding of near-ties).
//
// Per sequence, as QTIP: a free pass over the sequence rotated by half its length picks state 0's
// high 16-s bits (the overlap); a second pass starts from states with those bits and ends in states
// whose low 16-s bits equal them. Sequences are processed kTcqMaxBatch at a time (they share the
// reads of the state table), batches spread over threads with parallel_for (common/parallel.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "common/dispatch.h"
#include "common/tcq.h"
#include "common/parallel.h"

namespace torch_lowbit {
namespace {

constexpr int kWeightsPerSequence = 2 * kTcqSteps;
constexpr int kHalf = kTcqSteps / 2;

TcqStepFn step_for(CpuPath p) {
#if defined(TORCH_LOWBIT_X86)
  p = kernel_isa(p);
  if (p == CpuPath::Avx512) return tcq_step_avx512;
  if (p == CpuPath::Avx2) return tcq_step_avx2;
#endif
  return tcq_step_scalar;
}

// Forward passes and tracebacks for up to kTcqMaxBatch sequences; owns the per-step cost history
// (128 x batch x 2^(16-s) floats), which replaces backpointers: the traceback recomputes the 2^s
// candidate costs of one group per step and takes the first that equals the stored minimum.
class SequenceBatchEncoder {
 public:
  SequenceBatchEncoder(const TcqCode& code, TcqStepFn step)
      : code_(code),
        step_(step),
        shift_(code.shift),
        groups_(int64_t{1} << (kTcqStateBits - code.shift)),
        stride_(groups_ + kTcqGroupPad),
        history_(at::empty({kTcqSteps * kTcqMaxBatch * stride_}, at::kFloat)),
        start_(at::zeros({kTcqMaxBatch * stride_}, at::kFloat)) {}

  // x: batch sequences of 256 weights; writes states [batch, 128] and path errors [batch].
  void encode(const float* x, int batch, int32_t* states, float* errors) {
    // Pass 1: free start, rotated by half; its state at rotated step kHalf is state 0.
    std::fill_n(start(0), kTcqMaxBatch * stride_, 0.f);
    forward(x, batch, kHalf);
    int64_t overlap[kTcqMaxBatch];
    for (int i = 0; i < batch; ++i) {
      const float* last = cost(kTcqSteps - 1, i);
      const int64_t end_group = std::min_element(last, last + groups_) - last;  // first minimum
      overlap[i] = traceback(x, i, kHalf, end_group, kHalf, nullptr) >> shift_;
    }
    // Pass 2: start in the overlap's predecessor group, end in the overlap as successor group.
    std::fill_n(start(0), kTcqMaxBatch * stride_, std::numeric_limits<float>::infinity());
    for (int i = 0; i < batch; ++i) start(i)[overlap[i]] = 0.f;
    forward(x, batch, 0);
    for (int i = 0; i < batch; ++i) {
      traceback(x, i, 0, overlap[i], 0, states + i * kTcqSteps);
      double norm2 = 0;
      for (int j = 0; j < kWeightsPerSequence; ++j) norm2 += double(x[i * kWeightsPerSequence + j]) * x[i * kWeightsPerSequence + j];
      errors[i] = float(double(cost(kTcqSteps - 1, i)[overlap[i]]) + norm2);
    }
  }

 private:
  float* cost(int t, int i) { return history_.data_ptr<float>() + (int64_t(t) * kTcqMaxBatch + i) * stride_; }
  float* start(int i) { return start_.data_ptr<float>() + i * stride_; }
  const float* before(int t, int i) { return t > 0 ? cost(t - 1, i) : start(i); }

  // Trellis step t reads the sequence's step (t + rotation) % 128.
  static const float* target(const float* x, int i, int t, int rotation) {
    return x + i * kWeightsPerSequence + 2 * ((t + rotation) % kTcqSteps);
  }

  void forward(const float* x, int batch, int rotation) {
    const float* prev[kTcqMaxBatch];
    float* next[kTcqMaxBatch];
    float ax[kTcqMaxBatch], ay[kTcqMaxBatch];
    for (int t = 0; t < kTcqSteps; ++t) {
      for (int i = 0; i < batch; ++i) {
        const float* xt = target(x, i, t, rotation);
        ax[i] = -2.f * xt[0];
        ay[i] = -2.f * xt[1];
        prev[i] = before(t, i);
        next[i] = cost(t, i);
      }
      step_(code_, batch, prev, ax, ay, next);
    }
  }

  // Walks back from successor group end_group after the last step down to step `stop`; writes each
  // state to out[(t + rotation) % 128] when out is given; returns the state at step `stop`.
  int64_t traceback(const float* x, int i, int rotation, int64_t end_group, int stop, int32_t* out) {
    int64_t g = end_group, state = 0;
    for (int t = kTcqSteps - 1; t >= stop; --t) {
      const float* xt = target(x, i, t, rotation);
      const float ax = -2.f * xt[0], ay = -2.f * xt[1];
      const float* prev = before(t, i);
      const float best = cost(t, i)[g];
      const int64_t fan = int64_t{1} << shift_;
      int64_t k = 0;
      for (; k < fan; ++k) {
        const int64_t p = k * groups_ + g;
        if (tcq_state_cost(prev[p >> shift_], ax, ay, code_.cx[p], code_.cy[p], code_.c2[p]) == best) break;
      }
      TORCH_CHECK(k < fan, "tcq_viterbi: internal error, traceback found no predecessor");
      state = k * groups_ + g;
      if (out) out[(t + rotation) % kTcqSteps] = int32_t(state);
      g = state >> shift_;
    }
    return state;
  }

  const TcqCode code_;
  const TcqStepFn step_;
  const int shift_;
  const int64_t groups_, stride_;
  at::Tensor history_, start_;
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> tcq_viterbi_cpu(const at::Tensor& sequences, const at::Tensor& state_values,
                                                   int64_t shift_bits) {
  TORCH_CHECK(shift_bits >= 3 && shift_bits <= 10,
              "tcq_viterbi: shift_bits must be in 3..10 (tcq1.5 .. tcq5, 2 weights per step), got ", shift_bits);
  TORCH_CHECK(sequences.scalar_type() == at::kFloat && sequences.dim() == 2 &&
                  sequences.size(1) == kWeightsPerSequence,
              "tcq_viterbi: sequences must be fp32 [N, ", kWeightsPerSequence, "], got ", sequences.scalar_type(),
              " ", sequences.sizes());
  TORCH_CHECK(state_values.scalar_type() == at::kFloat && state_values.dim() == 2 &&
                  state_values.size(0) == kTcqStates && state_values.size(1) == 2,
              "tcq_viterbi: state_values must be fp32 [", kTcqStates, ", 2], got ", state_values.scalar_type(), " ",
              state_values.sizes());
  TORCH_CHECK(at::isfinite(sequences).all().item<bool>(), "tcq_viterbi: sequences contain non-finite values");
  TORCH_CHECK(at::isfinite(state_values).all().item<bool>(), "tcq_viterbi: state_values contain non-finite values");

  const at::Tensor x = sequences.contiguous();
  // Separate, 64-byte aligned coordinate arrays (ATen's CPU allocator aligns to 64 bytes).
  const at::Tensor cx = state_values.select(1, 0).contiguous();
  const at::Tensor cy = state_values.select(1, 1).contiguous();
  const at::Tensor c2 = (cx * cx + cy * cy).contiguous();
  const int64_t fan = int64_t{1} << shift_bits, groups = kTcqStates / fan;
  const auto blocked = [&](const at::Tensor& t) { return t.view({fan, groups / 16, 16}).transpose(0, 1).contiguous(); };
  const at::Tensor cxb = blocked(cx), cyb = blocked(cy), c2b = blocked(c2);
  const TcqCode code{cx.data_ptr<float>(),  cy.data_ptr<float>(),  c2.data_ptr<float>(), cxb.data_ptr<float>(),
                     cyb.data_ptr<float>(), c2b.data_ptr<float>(), int(shift_bits)};
  const TcqStepFn step = step_for(active_cpu_path());

  const int64_t n = x.size(0);
  at::Tensor states = at::empty({n, kTcqSteps}, at::kInt);
  at::Tensor errors = at::empty({n}, at::kFloat);
  const float* xp = x.data_ptr<float>();
  int32_t* sp = states.data_ptr<int32_t>();
  float* ep = errors.data_ptr<float>();
  const int64_t batches = (n + kTcqMaxBatch - 1) / kTcqMaxBatch;
  parallel_for(0, batches, 1, [&](int64_t begin, int64_t end) {
    SequenceBatchEncoder encoder(code, step);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * kTcqMaxBatch;
      const int count = int(std::min<int64_t>(kTcqMaxBatch, n - first));
      encoder.encode(xp + first * kWeightsPerSequence, count, sp + first * kTcqSteps, ep + first);
    }
  });
  return {states, errors};
}

}  // namespace torch_lowbit

TORCH_LIBRARY_IMPL(torch_lowbit, CPU, m) {
  m.impl("tcq_viterbi", &torch_lowbit::tcq_viterbi_cpu);
}
