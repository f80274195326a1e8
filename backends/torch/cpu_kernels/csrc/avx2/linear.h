// linear.cpp's tile kernel with AVX2 (included by linear.cpp inside its namespace, in place
// of the AVX-512 one), over the same packed layout.
//
// 16 ymm registers do not hold 6 rows x 64 columns of accumulators, so a tile is worked in
// four sub-tiles of 16 columns: each K step of a sub-tile is one cache line of the tile (fp32:
// 16 columns; bf16: 16 columns x 2 K), times up to 6 rows of x, into 12 accumulators. Two or
// more rows take the tile in 16 KB chunks of K (`rows_of_tile`), the next chunk streaming in
// while this one computes from L1. One row alone (B = 1, bound by memory) takes all 64 columns
// per K step instead, so the tile is read front to back in one stream. bf16 weights are widened
// in registers (a K pair's even element is the low half of a 32-bit lane, the odd one the high
// half), x once per chunk into an fp32 buffer; the products are fp32 FMAs.
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

// K steps of a chunk: 16 KB of a tile (fp32: 64 K values; bf16: 64 pairs)
constexpr int64_t kChunkSteps = 64;
constexpr int64_t kChunkBytes = kChunkSteps * kTileCols * 4;
constexpr int64_t kLinesPerStep = kTileCols * 4 / 64;  // cache lines of one K step of a tile

// part[m][0..15] += x[m] . (the sub-tile's 16 columns) over `steps` K steps from w, for R rows
// of x (fp32, row stride ldx, from the chunk's first K value); the sums start from zero where
// `first`. Each step also asks for kLines cache lines of `ahead` (the next chunk's), so that
// the next chunk streams in from memory while this one computes from L1. kLines = kOwnLines
// (rows_lines' other case, shapes.h) asks for none, as 0 does.
template <typename T, int R, int kLines>
void subtile(const float* x, int64_t ldx, int64_t steps, const T* w, float* part, bool first,
             const char* ahead) {
  __m256 acc[R][2];
  CAROUSEL_UNROLL for (int m = 0; m < R; ++m) {
    acc[m][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + m * kTileCols);
    acc[m][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + m * kTileCols + 8);
  }
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t k = i * kStepOf<T>;
    const T* wk = w + k * kTileCols;
    CAROUSEL_UNROLL for (int l = 0; l < kLines; ++l)
      _mm_prefetch(ahead + 64 * (i * kLines + l), _MM_HINT_T0);
    if constexpr (std::is_same_v<T, float>) {
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
      CAROUSEL_UNROLL for (int m = 0; m < R; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
        acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
      }
    } else {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16));
      const __m256 e0 = even_half(v0), e1 = even_half(v1);
      CAROUSEL_UNROLL for (int m = 0; m < R; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
        acc[m][0] = _mm256_fmadd_ps(xb, e0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xb, e1, acc[m][1]);
      }
      const __m256 o0 = odd_half(v0), o1 = odd_half(v1);
      CAROUSEL_UNROLL for (int m = 0; m < R; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k + 1);
        acc[m][0] = _mm256_fmadd_ps(xb, o0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xb, o1, acc[m][1]);
      }
    }
  }
  CAROUSEL_UNROLL for (int m = 0; m < R; ++m) {
    _mm256_storeu_ps(part + m * kTileCols, acc[m][0]);
    _mm256_storeu_ps(part + m * kTileCols + 8, acc[m][1]);
  }
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

// columns [k0, k0 + n) of every row of x as fp32, row stride n, widened into `buf` (bf16)
inline const float* fp32_block(const float* x, int64_t, int64_t K, int64_t k0, int64_t,
                               std::vector<float>&, int64_t& ldx) {
  ldx = K;
  return x + k0;
}

inline const float* fp32_block(const at::BFloat16* x, int64_t M, int64_t K, int64_t k0, int64_t n,
                               std::vector<float>& buf, int64_t& ldx) {
  buf.resize(M * n);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < n; i += kLanes)
      store(buf.data() + m * n + i, load(x + m * K + k0 + i, n - i), n - i);
  ldx = n;
  return buf.data();
}

// Every row of x against one tile, K chunk by K chunk (16 KB of weights each). Within a chunk,
// sub-tile by sub-tile, up to kPassRows rows at a time, the sums kept in `part` (fp32, M rows
// of kTileCols) between chunks: each sum still takes its products in K order, so the bits are
// those of one pass over all of K. A chunk's first passes read it from memory; the next 16 KB
// (the tile's next chunk, or the next tile's first: a thread takes its tiles in order) is asked
// for a quarter a pass meanwhile, so that later chunks stream in while the passes before them
// compute from L1. Before, each sub-tile pass went over all of K, a tile re-read from L2 by
// stride for every 6 rows (0.84x oneDNN at 8 rows).
template <Epilogue E, typename T>
void rows_of_tile(const T* x, int64_t M, int64_t K, const T* w, const float* bias, T* y,
                  int64_t N, int64_t cols) {
  thread_local std::vector<float> buf, part;
  if (M == 1) {
    int64_t ldx;
    __m256 acc[8];
    row_all_columns<T>(fp32_block(x, 1, K, 0, K, buf, ldx), K, w, acc);
    if constexpr (E == Epilogue::kPlain) {
      for (int g = 0; g < 8 && 8 * g < cols; ++g) store_plain(acc[g], bias, g, y, cols);
    } else {
      for (int g = 0; g < 4 && 8 * g < cols; ++g) store_silu_mul(acc[g], acc[g + 4], g, y, cols);
    }
    return;
  }
  // the sub-tiles that hold output columns: plain, 16 columns each; gate/up, gate's and up's
  int subs[4], num_subs = 0;
  for (int s = 0; s < 4; ++s) {
    const int64_t first_col = E == Epilogue::kPlain ? 16 * s : 16 * (s % 2);
    if (first_col < cols) subs[num_subs++] = s;
  }
  part.resize(M * kTileCols);
  const int64_t row_blocks = (M + kPassRows - 1) / kPassRows, passes = num_subs * row_blocks;
  const int64_t quarters = passes >= 4 ? 4 : passes >= 2 ? 2 : 1;  // passes that ask ahead
  const int64_t chunk = kChunkSteps * kStepOf<T>;                  // K values
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t n = std::min(chunk, K - k0), steps = n / kStepOf<T>;
    int64_t ldx;
    const float* xc = fp32_block(x, M, K, k0, n, buf, ldx);
    const T* wc = w + k0 * kTileCols;
    const char* next = reinterpret_cast<const char*>(wc + n * kTileCols);
    int64_t p = 0;
    for (int i = 0; i < num_subs; ++i) {
      const T* ws = wc + 16 * subs[i] * kStepOf<T>;
      for (int64_t m0 = 0; m0 < M; m0 += kPassRows, ++p) {
        const float* xm = xc + m0 * ldx;
        float* pm = part.data() + m0 * kTileCols + 16 * subs[i];
        const int64_t lines = p < quarters ? kLinesPerStep / quarters : 0;
        const char* ahead = next + p * kChunkBytes / quarters;
        const int64_t rows = std::min<int64_t>(kPassRows, M - m0);
        rows_lines(rows, lines, [&](auto r, auto l) {
          subtile<T, decltype(r)::value, decltype(l)::value>(xm, ldx, steps, ws, pm, k0 == 0, ahead);
        });
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* pm = part.data() + m * kTileCols;
    T* ym = y + m * N;
    if constexpr (E == Epilogue::kPlain) {
      for (int g = 0; g < 8 && 8 * g < cols; ++g)
        store_plain(_mm256_loadu_ps(pm + 8 * g), bias, g, ym, cols);
    } else {
      for (int g = 0; g < 4 && 8 * g < cols; ++g)
        store_silu_mul(_mm256_loadu_ps(pm + 8 * g), _mm256_loadu_ps(pm + 8 * (g + 4)), g, ym, cols);
    }
  }
}
