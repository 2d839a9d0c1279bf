// Splits M tokens into register-blocked runs of up to 4 (the count is a compile-time constant for
// the microkernel, so its accumulators stay in registers).
#pragma once
#include <cstdint>
#include <type_traits>

namespace torch_lowbit {

template <int N>
using TokenCount = std::integral_constant<int, N>;

// Calls f(TokenCount<T>{}, m0) for consecutive runs [m0, m0 + T) covering [0, M).
template <typename F>
inline void for_token_blocks(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) f(TokenCount<4>{}, m);
  switch (M - m) {
    case 3: f(TokenCount<3>{}, m); break;
    case 2: f(TokenCount<2>{}, m); break;
    case 1: f(TokenCount<1>{}, m); break;
    default: break;
  }
}

}  // namespace torch_lowbit
