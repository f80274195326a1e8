// bf16 linear tiles by AMX (Sapphire Rapids and later), over the very packed layout of the
// AVX512-BF16 path: [N / 64][K / 2][64][2] is, for 16 columns and 16 pairs of K, an AMX B
// tile in its VNNI order (16 rows of 64 bytes, 256 bytes apart). One TDPBF16PS does
// 16 x 16 x 32 multiply-adds, 16 times a vdpbf16ps pass over the same registers, so past a
// few rows a tile's arithmetic stops mattering and only its memory stream is left.
// SmolLM2's 30 layers of linears, bf16, on a 2-core AMX Xeon (KVM guest): 1.0x the
// AVX512-BF16 path at 1 row, 1.5x at 8, 2.5x at 16, 4.1x at 32, 5.4x at 64
// (docs/benchmarks/history/).
//
// Included by linear.cpp inside its anonymous namespace, after store_row, where the build
// targets AMX (-mamx-tile -mamx-bf16).
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

constexpr int kRows = 16;   // rows of x per block (an A tile's rows)
constexpr int kKStep = 32;  // K values per pass step (an A tile row: 64 bytes of bf16)
constexpr int kPairRowBytes = kTileCols * 2 * 2;  // one K pair of a packed tile: 64 x 2 bf16

// Linux hands out the tile registers' state only on request, once per process
inline bool permitted() {
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  static const bool ok = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return ok;
}

// ldtilecfg's 64-byte operand (palette 1)
struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kPassRows = 2 * kRows;  // rows of x per pass over a tile: two blocks of 16

// tmm0-3: fp32 sums, 2 x 2 blocks (rows 0 or 1) x (columns 16 wide); tmm4, tmm5: the two
// blocks of x (rows x 32 bf16); tmm6, tmm7: the weights of two groups of 16 columns (16 K
// pairs x 16 columns x 2). Block 0 takes the rows past a multiple of 16 (`first` of them).
inline void configure(int first) {
  Config c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = kRows;
    c.colsb[t] = 64;
  }
  c.rows[0] = c.rows[1] = c.rows[4] = static_cast<uint8_t>(first);
  _tile_loadconfig(&c);
}

// Every row of x against one packed tile (K a multiple of kKStep); y is the tile's first
// column. A pass takes up to 32 rows and the tile's 64 columns in two halves, each loaded
// weight tile meeting both blocks of rows (2 x 2 register blocking: one tile load per
// TDPBF16PS). The next K step's lines are prefetched; a later pass reads the tile from L2.
template <Epilogue E>
void rows_of_tile(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w,
                  const float* bias, at::BFloat16* y, int64_t N, int64_t cols) {
  alignas(64) float sums[kPassRows][kTileCols];
  const int64_t x_stride = K * static_cast<int64_t>(sizeof(at::BFloat16));
  constexpr int64_t kSumStride = kTileCols * sizeof(float);
  for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
    const int64_t rows = std::min<int64_t>(kPassRows, M - m0);
    const bool two = rows > kRows;
    const int first = static_cast<int>(two ? rows - kRows : rows);
    configure(first);
    const at::BFloat16* x0 = x + m0 * K;
    const at::BFloat16* x1 = x0 + first * K;
    for (int half = 0; half < 2; ++half) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const at::BFloat16* wh = w + kTileCols * half;  // columns 32 * half on, per K pair
      for (int64_t k = 0; k < K; k += kKStep) {
        const at::BFloat16* wk = wh + k * kTileCols;
        const char* ahead = reinterpret_cast<const char*>(wk + 2 * kKStep * kTileCols);
        for (int p = 0; p < kRows; ++p) {  // this half's two lines of each K pair, 2 steps on
          _mm_prefetch(ahead + p * kPairRowBytes, _MM_HINT_T0);
          _mm_prefetch(ahead + p * kPairRowBytes + 64, _MM_HINT_T0);
        }
        _tile_loadd(4, x0 + k, x_stride);
        _tile_loadd(6, wk, kPairRowBytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, wk + 32, kPairRowBytes);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, x1 + k, x_stride);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* s = &sums[0][32 * half];
      _tile_stored(0, s, kSumStride);
      _tile_stored(1, s + 16, kSumStride);
      if (two) {
        _tile_stored(2, s + first * kTileCols, kSumStride);
        _tile_stored(3, s + first * kTileCols + 16, kSumStride);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 acc[4] = {_mm512_load_ps(&sums[r][0]), _mm512_load_ps(&sums[r][16]),
                             _mm512_load_ps(&sums[r][32]), _mm512_load_ps(&sums[r][48])};
      store_row<E>(acc, bias, y + (m0 + r) * N, cols);
    }
  }
  // NOTE: released after every tile: oneDNN's AMX kernels (prefills) share these threads
  // and configure the tiles their own way (a thread that assumed its own configuration
  // still loaded after them would fault on the next tile load)
  _tile_release();
}

}  // namespace amx
