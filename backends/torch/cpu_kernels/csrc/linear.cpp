// Decode-sized linears that stream each weight once at memory speed.
//
// The weight is packed in tiles of kTileCols output rows, each tile contiguous in memory, so
// a thread reads one sequential stream (what the hardware prefetcher is best at):
//   bf16: [N / 64][K / 2][64][2]  (pairs of K, the operand order of vdpbf16ps)
//   fp32: [N / 64][K][64]
// For every K step the tile's 64 weights are multiplied with up to kRows rows of x, broadcast
// one element (bf16: one pair) at a time, into 4 x kRows fp32 accumulators: no horizontal
// reductions. More rows than kRows re-read the tile in further passes: on Intel fp32 up to
// kChunkedRows rows from L1, 16 KB chunk by chunk; otherwise from L2 (stream_plan()).
//
// linear_silu_mul: the MLP's gate and up projections and its activation in one pass. Its
// weight interleaves them, 32 gate rows then the same 32 up rows per tile (pack_gate_up), so
// each tile's accumulators hold both halves of 32 outputs: silu(gate) * up is taken in
// registers and only the product is stored (no gate or up tensors, no third kernel).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "shapes.h"
#include "simd.h"
#include "tasks.h"

namespace carousel {
namespace {

#if defined(__AVX512F__)
constexpr int kRows = 6;  // rows of x per pass: 24 accumulators + 4 weight vectors in 32 zmm

template <typename T>
struct Traits;

template <>
struct Traits<at::BFloat16> {
  static constexpr int64_t kStep = 2;  // K elements per broadcast
  static inline void load(const at::BFloat16* w, __m512i (&wv)[4]) {
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512(w + 32 * j);
  }
  static inline __m512i broadcast(const at::BFloat16* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return _mm512_set1_epi32(pair);
  }
  static inline __m512 madd(__m512 acc, __m512i x, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
};

template <>
struct Traits<float> {
  static constexpr int64_t kStep = 1;
  static inline void load(const float* w, __m512i (&wv)[4]) {
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_castps_si512(_mm512_loadu_ps(w + 16 * j));
  }
  static inline __m512i broadcast(const float* x) {
    return _mm512_castps_si512(_mm512_set1_ps(*x));
  }
  static inline __m512 madd(__m512 acc, __m512i x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(w), acc);
  }
};
#endif

// What a tile's accumulators become: the plain product (64 columns, plus bias), or
// silu(gate) * up of a gate/up tile (32 columns)
enum class Epilogue { kPlain, kSiluMul };

template <Epilogue E>
constexpr int64_t kOutCols = E == Epilogue::kPlain ? kTileCols : kTileCols / 2;

#if defined(__AVX512F__)
template <Epilogue E, typename T>
inline void store_row(const __m512 (&acc)[4], const float* bias, T* y, int64_t cols) {
  if constexpr (E == Epilogue::kSiluMul) {
    // gate and up rounded to T first, as the two projections' outputs would be
    for (int j = 0; j < 2; ++j)
      store(y + kLanes * j, silu_mul_vec(round_to(acc[j], y), round_to(acc[j + 2], y), y),
            tail_mask(cols - kLanes * j));
  } else {
    for (int j = 0; j < 4; ++j) {
      __m512 v = acc[j];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + kLanes * j));
      store(y + kLanes * j, v, tail_mask(cols - kLanes * j));  // bf16: nearest even, as torch
    }
  }
}

// `R` (<= kRows) rows of x against K values [k0, k1) of one packed tile; y points at the
// tile's first column. The sums start from zero at k0 = 0, else from `partial` (R rows of
// kTileCols fp32); over the tile's last K values they go through the epilogue to y, else
// back to `partial`. The sums keep every product's order, so a tile taken in K chunks gives
// the very bits of one taken whole. Weights asked for ahead of use: with L = kOwnLines its own
// lines a few K steps on; with L = 0 none (the hardware prefetcher's stream alone); else L
// lines a K step from `ahead` on, the next chunk's, which then streams in while this pass
// computes.
template <Epilogue E, typename T, int R, int L>
void tile(const T* x, int64_t K, int64_t k0, int64_t k1, const T* w, float* partial,
          const float* bias, T* y, int64_t N, int64_t cols, const char* ahead) {
  using Tr = Traits<T>;
  __m512 acc[R][4];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < 4; ++j)
      acc[m][j] =
          k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + m * kTileCols + kLanes * j);
  for (int64_t k = k0; k < k1; k += Tr::kStep) {
    const T* wk = w + k * kTileCols;
    if constexpr (L == kOwnLines) {
      _mm_prefetch(reinterpret_cast<const char*>(wk + 8 * kTileCols * Tr::kStep), _MM_HINT_T0);
    } else if constexpr (L > 0) {
      for (int l = 0; l < L; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
      ahead += 64 * L;
    }
    __m512i wv[4];
    Tr::load(wk, wv);
    for (int m = 0; m < R; ++m) {
      __m512i xv = Tr::broadcast(x + m * K + k);
      for (int j = 0; j < 4; ++j) acc[m][j] = Tr::madd(acc[m][j], xv, wv[j]);
    }
  }
  if (k1 == K) {
    for (int m = 0; m < R; ++m) store_row<E>(acc[m], bias, y + m * N, cols);
  } else {
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(partial + m * kTileCols + kLanes * j, acc[m][j]);
  }
}

// How a tile's weights are asked for ahead of use, and whether fp32 tiles of a few passes go in
// K chunks. The hardware prefetchers differ by vendor, and so does what pays (all linears of
// the default model, interleaved in one process; docs/benchmarks/history/):
// - Intel (the AMX Xeon, where bf16 takes AMX tiles and this path is fp32's): a pass that
//   streams asks for its own lines 8 K steps on; fp32 tiles of kRows + 1 to kChunkedRows rows
//   go in 16 KB chunks of K, the second pass asking for the whole next chunk (1.09-1.23x whole
//   passes at 8-32 rows; spreading the asking over more passes no better).
// - AMD (Zen 4): no request of a streaming pass's own lines, the hardware's stream alone (1.43x
//   at 1 row and 1.23x at 4 in fp32, 1.10-1.26x at 1-32 rows in bf16), and whole passes: the
//   first streams the tile from memory, the others re-read it from L2 (fp32 1.03-1.32x the
//   chunks at 7-32 rows, even with each chunk's passes sharing the asking for the next one;
//   asking for the next tile during the passes from L2 0.78-1.09x).
// `set_stream_plan` switches it (the suite checks both plans' bits on any CPU).
struct StreamPlan {
  std::atomic<bool> own_lines;  // a streaming pass asks for its own lines ahead
  std::atomic<bool> chunked;    // fp32 tiles of kRows + 1 to kChunkedRows rows go in K chunks
};

StreamPlan& stream_plan() {
  static StreamPlan plan = [] {
    __builtin_cpu_init();
    const bool intel = !__builtin_cpu_is("amd");
    return StreamPlan{{intel}, {intel}};
  }();
  return plan;
}

// K values per chunk of a tile that several passes of rows share: 16 KB of weights.
// Taken whole, a tile's first pass of rows streams it from memory at memory speed, and the
// later passes re-read it from L2 at compute speed, one after the other; in chunks, the second
// pass asks for the next chunk while the passes compute (`tile`'s ahead), and the stream
// overlaps them. fp32 on the Xeon, interleaved in one process: 1.09-1.23x whole passes at 8-32
// rows, even at 64 and 0.92x at 128 (the partial sums of that many rows no
// longer fit L1 beside the chunk), so more rows keep whole passes. bf16 by vdpbf16ps keeps
// them too: 0.93-0.95x at 8 rows, 1.04-1.08x at 13-32 on the Xeon; on Zen 4 no
// dtype gains by chunks.
constexpr int64_t kChunkBytes = 16384;
template <typename T>
constexpr int64_t kChunk = kChunkBytes / (kTileCols * sizeof(T));
constexpr int64_t kChunkedRows = 32;

template <Epilogue E, typename T>
void rows_of_tile(const T* x, int64_t M, int64_t K, const T* w, const float* bias, T* y,
                  int64_t N, int64_t cols) {
  constexpr int64_t kLines = kTileCols * Traits<T>::kStep * sizeof(T) / 64;  // per K step
  const StreamPlan& plan = stream_plan();
  thread_local std::vector<float> partial;
  const bool chunked = plan.chunked.load(std::memory_order_relaxed) &&
                       std::is_same_v<T, float> && M > kRows && M <= kChunkedRows;
  const int64_t chunk = chunked ? kChunk<T> : K;
  partial.resize(M * kTileCols);  // once per thread and size
  // what a pass that asks for no next chunk does
  const int64_t streaming = plan.own_lines.load(std::memory_order_relaxed) ? kOwnLines : 0;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    const bool ask = chunked && k1 < K;  // the second pass asks for this tile's next chunk
    const char* next = reinterpret_cast<const char*>(w + k1 * kTileCols);
    for (int64_t m = 0; m < M; m += kRows) {
      const bool asks = ask && m == kRows;
      rows_lines(std::min<int64_t>(kRows, M - m), asks ? kLines : streaming,
                 [&](auto r, auto l) {
                   tile<E, T, decltype(r)::value, decltype(l)::value>(
                       x + m * K, K, k0, k1, w, partial.data() + m * kTileCols, bias, y + m * N,
                       N, cols, asks ? next : nullptr);
                 });
    }
  }
}
#if defined(__AMX_BF16__)
#include "amx.h"
#endif
#else
#include "avx2/linear.h"
#endif

// the fewest rows of x that take AMX tiles (bf16, where the build and the OS allow them)
std::atomic<int64_t> amx_min_rows{1};

template <typename T>
bool takes_amx(int64_t M, int64_t K) {
#if defined(__AMX_BF16__)
  return std::is_same_v<T, at::BFloat16> && K % amx::kKStep == 0 &&
         M >= amx_min_rows.load(std::memory_order_relaxed) && amx::permitted();
#else
  return false;
#endif
}

// every row of x against one packed tile, by AMX tiles (`amx`, bf16 only) or vector FMAs
template <Epilogue E, typename T>
void tile_rows(bool amx, const T* x, int64_t M, int64_t K, const T* w, const float* bias, T* y,
               int64_t N, int64_t cols) {
#if defined(__AMX_BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (amx) return amx::rows_of_tile<E>(x, M, K, w, bias, y, N, cols);
  }
#endif
  rows_of_tile<E, T>(x, M, K, w, bias, y, N, cols);
}

template <Epilogue E, typename T>
void run(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor* bias,
         torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t tiles = packed.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = packed.data_ptr<T>();
  const float* bp = bias != nullptr ? bias->data_ptr<float>() : nullptr;
  T* yp = y.data_ptr<T>();
  const bool amx = takes_amx<T>(M, K);
  // NOTE: a tile is one sequential stream of its weights; the threads claim tiles in turn
  parallel_tasks(tiles, [&](int64_t t) {
    const int64_t col = t * kOutCols<E>;
    tile_rows<E, T>(amx, xp, M, K, wp + t * K * kTileCols, bp != nullptr ? bp + col : nullptr,
                    yp + col, N, std::min(kOutCols<E>, N - col));
  });
}

void check_packed(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (M, K) matrix");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  packed.scalar_type() == x.scalar_type(),
              "packed weight must come from pack_weight for x's dtype");
  TORCH_CHECK(packed.size(1) * packed.size(2) == x.size(1) * kTileCols,
              "weight and x disagree on K");
}

template <Epilogue E>
torch::Tensor linear_with(const torch::Tensor& x, const torch::Tensor& packed,
                          int64_t out_features, const torch::Tensor* bias, const char* name) {
  auto y = torch::empty({x.size(0), out_features}, x.options());
  dispatch(x.scalar_type(), name, [&](auto t) {
    using T = decltype(t);
    constexpr bool bf16 = std::is_same_v<T, at::BFloat16>;
    TORCH_CHECK(!bf16 || x.size(1) % 2 == 0, "bf16 needs an even K");
    run<E, T>(x, packed, bias, y);
  });
  return y;
}

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                     const c10::optional<torch::Tensor>& bias) {
  check_packed(x, packed);
  TORCH_CHECK(out_features <= packed.size(0) * kTileCols, "more out_features than packed rows");
  const torch::Tensor* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == packed.size(0) * kTileCols,
                "bias must be fp32, padded to whole tiles (pack_bias)");
    bp = &*bias;
  }
  return linear_with<Epilogue::kPlain>(x, packed, out_features, bp, "linear");
}

int64_t set_amx_min_rows(int64_t rows) { return amx_min_rows.exchange(rows); }

std::tuple<bool, bool> set_stream_plan(bool own_lines, bool chunked) {
#if defined(__AVX512F__)
  StreamPlan& plan = stream_plan();
  return {plan.own_lines.exchange(own_lines), plan.chunked.exchange(chunked)};
#else
  (void)own_lines, (void)chunked;  // the AVX2 build has one plan: chunks from two rows
  return {false, true};
#endif
}

bool amx_built() {
#if defined(__AMX_BF16__)
  return amx::permitted();
#else
  return false;
#endif
}

torch::Tensor linear_silu_mul(const torch::Tensor& x, const torch::Tensor& packed,
                              int64_t out_features) {
  check_packed(x, packed);
  TORCH_CHECK(out_features <= packed.size(0) * kOutCols<Epilogue::kSiluMul>,
              "more out_features than packed gate/up rows");
  return linear_with<Epilogue::kSiluMul>(x, packed, out_features, nullptr, "linear_silu_mul");
}

}  // namespace carousel
