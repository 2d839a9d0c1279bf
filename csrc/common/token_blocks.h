// Splits M tokens into register-blocked runs (the count is a compile-time constant for the
// microkernel, so its accumulators stay in registers).
#pragma once
#include <cstdint>
#include <type_traits>
#include <utility>

namespace torch_lowbit {

template <int N>
using TokenCount = std::integral_constant<int, N>;

namespace detail {
template <int T, typename F>
inline void run_tail(int64_t rest, int64_t m, F& f) {
  if constexpr (T > 0) {
    if (rest == T) {
      f(TokenCount<T>{}, m);
      return;
    }
    run_tail<T - 1>(rest, m, f);
  }
}
}  // namespace detail

// Calls f(TokenCount<T>{}, m0) for consecutive runs [m0, m0 + T) covering [0, M), T <= MaxT.
template <int MaxT = 4, typename F>
inline void for_token_blocks(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + MaxT <= M; m += MaxT) f(TokenCount<MaxT>{}, m);
  detail::run_tail<MaxT - 1>(M - m, m, f);
}

}  // namespace torch_lowbit
