// Run-time tile shapes as compile-time constants, for the linear kernels (linear.cpp and its
// AVX2 implementation, avx2/linear.h), so each shape's loops unroll into registers.
#pragma once

#include <cstdint>
#include <type_traits>

namespace carousel {

// A pass's `lines` that asks for its own weight lines a few K steps on (the AVX-512 kernel's
// plan on Intel); a kernel without that request treats it as asking for none.
constexpr int kOwnLines = -1;

// f(rows, lines) with both as std::integral_constant: rows 1..6 (anything else runs as 1),
// lines 4, 2, 1, 0 or kOwnLines (anything else)
template <typename F>
void rows_lines(int64_t rows, int64_t lines, F&& f) {
  auto with_lines = [&](auto r) {
    switch (lines) {
      case 4: f(r, std::integral_constant<int, 4>{}); break;
      case 2: f(r, std::integral_constant<int, 2>{}); break;
      case 1: f(r, std::integral_constant<int, 1>{}); break;
      case 0: f(r, std::integral_constant<int, 0>{}); break;
      default: f(r, std::integral_constant<int, kOwnLines>{}); break;
    }
  };
  switch (rows) {
    case 6: with_lines(std::integral_constant<int, 6>{}); break;
    case 5: with_lines(std::integral_constant<int, 5>{}); break;
    case 4: with_lines(std::integral_constant<int, 4>{}); break;
    case 3: with_lines(std::integral_constant<int, 3>{}); break;
    case 2: with_lines(std::integral_constant<int, 2>{}); break;
    default: with_lines(std::integral_constant<int, 1>{}); break;
  }
}

}  // namespace carousel
