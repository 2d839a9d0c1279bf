// Portable TCQ Viterbi step: the reference the vectorized steps must equal bit for bit.
#include <limits>

#include "common/tcq.h"

namespace torch_lowbit {

void tcq_step_scalar(const TcqCode& code, int batch, const float* const* prev, const float* ax,
                     const float* ay, float* const* next) {
  const int s = code.shift;
  const int64_t groups = int64_t{1} << (kTcqStateBits - s), fan = int64_t{1} << s;
  for (int i = 0; i < batch; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      float best = std::numeric_limits<float>::infinity();
      for (int64_t k = 0; k < fan; ++k) {
        const int64_t p = k * groups + g;
        const float cost = tcq_state_cost(prev[i][p >> s], ax[i], ay[i], code.cx[p], code.cy[p], code.c2[p]);
        best = best < cost ? best : cost;  // as vminps(best, cost)
      }
      next[i][g] = best;
    }
  }
}

}  // namespace torch_lowbit
