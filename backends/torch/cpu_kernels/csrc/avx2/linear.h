// linear.cpp's tile kernel with AVX2 (included by linear.cpp inside its namespace, in place
// of the AVX-512 one), over the same packed layout.
//
// 16 ymm registers do not hold 6 rows x 64 columns of accumulators, so a tile is worked in
// four sub-tiles of 16 columns: each K step of a sub-tile is one cache line of the tile (fp32:
// 16 columns; bf16: 16 columns x 2 K), times up to 6 rows of x, into 12 accumulators. One
// row alone (B = 1, bound by memory) takes all 64 columns per K step instead, so the tile is
// read front to back in one stream. bf16 weights are widened in registers (a K pair's even
// element is the low half of a 32-bit lane, the odd one the high half), x once per pass into
// an fp32 buffer; the products are fp32 FMAs.
#pragma once

#include <vector>

constexpr int kPassRows = 6;  // rows of x per sub-tile pass: 12 accumulators in 16 ymm

// NOTE: GCC 12 at -O3 kept a register block's accumulator array in registers *and* stored
// every accumulator to the stack at every K step (12 stores per 12 FMAs: the store port, not
// the FMAs, set the pace: 26-29 GFLOP/s a core on an L1-resident tile, a third of Zen 3's
// peak). Unrolling the loops over the block's rows early (before the array is scalarized)
// leaves only the FMAs; the AVX-512 tile kernel's loops compile clean without it.
#define CAROUSEL_UNROLL _Pragma("GCC unroll 16")

inline __m256 even_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd_half(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <typename T>
constexpr int64_t kStepOf = std::is_same_v<T, at::BFloat16> ? 2 : 1;  // K elements per step

// out[m][h] = x[m] . (columns 8h..8h+7 of the sub-tile whose K step 0 starts at w)
// NOTE: the sums live in a local array, which the compiler keeps in registers; summing into
// the caller's array went through memory at every step (0.83x torch's kernels at 32 rows)
template <typename T, int R>
void subtile(const float* x, int64_t K, const T* w, __m256 (&out)[R][2]) {
  __m256 acc[R][2];
  CAROUSEL_UNROLL for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kStepOf<T>) {
    const T* wk = w + k * kTileCols;
    _mm_prefetch(reinterpret_cast<const char*>(wk + 8 * kTileCols * kStepOf<T>), _MM_HINT_T0);
    if constexpr (std::is_same_v<T, float>) {
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
      CAROUSEL_UNROLL for (int m = 0; m < R; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
        acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
      }
    } else {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16));
      const __m256 e0 = even_half(v0), e1 = even_half(v1);
      CAROUSEL_UNROLL for (int m = 0; m < R; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
        acc[m][0] = _mm256_fmadd_ps(xb, e0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xb, e1, acc[m][1]);
      }
      const __m256 o0 = odd_half(v0), o1 = odd_half(v1);
      CAROUSEL_UNROLL for (int m = 0; m < R; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * K + k + 1);
        acc[m][0] = _mm256_fmadd_ps(xb, o0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xb, o1, acc[m][1]);
      }
    }
  }
  CAROUSEL_UNROLL for (int m = 0; m < R; ++m) out[m][0] = acc[m][0], out[m][1] = acc[m][1];
}

// acc[g] = x . (columns 8g..8g+7 of the tile), one row against all 64 columns per K step
template <typename T>
void row_all_columns(const float* x, int64_t K, const T* w, __m256 (&out)[8]) {
  __m256 acc[8];
  CAROUSEL_UNROLL for (int g = 0; g < 8; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kStepOf<T>) {
    const T* wk = w + k * kTileCols;
    _mm_prefetch(reinterpret_cast<const char*>(wk + 4 * kTileCols * kStepOf<T>), _MM_HINT_T0);
    if constexpr (std::is_same_v<T, float>) {
      const __m256 xb = _mm256_broadcast_ss(x + k);
      CAROUSEL_UNROLL for (int g = 0; g < 8; ++g) acc[g] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(wk + 8 * g), acc[g]);
    } else {
      const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + k + 1);
      CAROUSEL_UNROLL for (int g = 0; g < 8; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16 * g));
        acc[g] = _mm256_fmadd_ps(x1, odd_half(v), _mm256_fmadd_ps(x0, even_half(v), acc[g]));
      }
    }
  }
  CAROUSEL_UNROLL for (int g = 0; g < 8; ++g) out[g] = acc[g];
}

// Output group g (8 columns from 8g) of one row, from its accumulators: the plain product
// plus bias, or (gate/up tiles) silu(gate) * up with gate at group g and up at g + 4.
template <typename T>
inline void store_plain(__m256 v, const float* bias, int64_t g, T* y, int64_t cols) {
  if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * g));
  store(y + 8 * g, v, cols - 8 * g);  // bf16: nearest even, as torch
}

template <typename T>
inline void store_silu_mul(__m256 gate, __m256 up, int64_t g, T* y, int64_t cols) {
  // gate and up rounded to T first, as the two projections' outputs would be
  store(y + 8 * g, silu_mul_vec(round_to(gate, y), round_to(up, y), y), cols - 8 * g);
}

// R rows of x (fp32, row stride K) against one tile, sub-tile by sub-tile
template <Epilogue E, typename T, int R>
void pass(const float* x, int64_t K, const T* w, const float* bias, T* y, int64_t N,
          int64_t cols) {
  __m256 acc[R][2];
  const T* sub[4];
  for (int s = 0; s < 4; ++s) sub[s] = w + 16 * s * kStepOf<T>;
  if constexpr (E == Epilogue::kPlain) {
    for (int s = 0; s < 4 && 16 * s < cols; ++s) {
      subtile<T, R>(x, K, sub[s], acc);
      for (int m = 0; m < R; ++m)
        for (int h = 0; h < 2; ++h) store_plain(acc[m][h], bias, 2 * s + h, y + m * N, cols);
    }
  } else {
    __m256 gate[R][2];
    for (int s = 0; s < 2 && 16 * s < cols; ++s) {
      subtile<T, R>(x, K, sub[s], gate);
      subtile<T, R>(x, K, sub[s + 2], acc);
      for (int m = 0; m < R; ++m)
        for (int h = 0; h < 2; ++h) store_silu_mul(gate[m][h], acc[m][h], 2 * s + h, y + m * N, cols);
    }
  }
}

// rows [m0, m0 + R) of x as fp32: x itself (fp32), or widened into `buf` (bf16)
template <typename T>
const float* fp32_rows(const T* x, int64_t K, int64_t m0, int64_t R, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return x + m0 * K;
  } else {
    buf.resize(R * K);
    for (int64_t i = 0; i < R * K; i += kLanes)
      store(buf.data() + i, load(x + m0 * K + i, R * K - i), R * K - i);
    return buf.data();
  }
}

template <Epilogue E, typename T>
void rows_of_tile(const T* x, int64_t M, int64_t K, const T* w, const float* bias, T* y,
                  int64_t N, int64_t cols) {
  thread_local std::vector<float> buf;
  if (M == 1) {
    __m256 acc[8];
    row_all_columns<T>(fp32_rows(x, K, 0, 1, buf), K, w, acc);
    if constexpr (E == Epilogue::kPlain) {
      for (int g = 0; g < 8 && 8 * g < cols; ++g) store_plain(acc[g], bias, g, y, cols);
    } else {
      for (int g = 0; g < 4 && 8 * g < cols; ++g) store_silu_mul(acc[g], acc[g + 4], g, y, cols);
    }
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
    const int64_t R = std::min<int64_t>(kPassRows, M - m0);
    const float* xr = fp32_rows(x, K, m0, R, buf);
    T* ym = y + m0 * N;
    switch (R) {
      case 6: pass<E, T, 6>(xr, K, w, bias, ym, N, cols); break;
      case 5: pass<E, T, 5>(xr, K, w, bias, ym, N, cols); break;
      case 4: pass<E, T, 4>(xr, K, w, bias, ym, N, cols); break;
      case 3: pass<E, T, 3>(xr, K, w, bias, ym, N, cols); break;
      case 2: pass<E, T, 2>(xr, K, w, bias, ym, N, cols); break;
      default: pass<E, T, 1>(xr, K, w, bias, ym, N, cols); break;
    }
  }
}
