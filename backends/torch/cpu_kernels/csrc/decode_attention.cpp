// Decode attention that reads K/V in place from the paged cache.
//
// One task per sequence (all its K/V heads), or per (sequence, K/V head) when there are too
// few sequences to keep every thread busy; the threads claim tasks as in tasks.h. A task
// walks its context one K/V head at a time. Scores: in groups of 16 keys, each group's K rows
// widened to fp32 once, the scores of its 16 keys for a query head out of one transposing sum
// (no horizontal reduction per key). Then the softmax. Then the values, key by key: each V
// row widened once into registers and taken by all the query heads (up to 12 / C at a time)
// whose sums stay in registers through the pass, summed in the order (and so to the bits) of
// the earlier kernel that read a widened copy of each group. The slots are listed once from
// the block table; rows are asked for ahead of use (blocks are scattered: the hardware
// prefetcher cannot follow): the next group of K rows, the V row 16 keys on, and across the
// end of a pass the first rows of the next one (V after K, the next head's K after V). fp32
// math throughout. AVX-512, 8 / 32 / 64 sequences of 72 keys: bf16 1.30 / 1.18 / 1.20x,
// fp32 1.10 / 1.09 / 1.08x the per-group value sums through a widened copy
// (docs/benchmarks/history/).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"
#include "tasks.h"

namespace carousel {
namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per K/V head
constexpr int64_t kKeys = kLanes;  // keys per group: one score vector

struct Shape {
  int64_t block_size, num_kv_heads, group, head_dim;
  float scale;
};

#if defined(__AVX512F__)
// lane k: the sum of the lanes of d[k]
inline __m512 sum16(const __m512* d) {
  __m512 r[4];
  for (int q = 0; q < 4; ++q) {
    const __m512* x = d + 4 * q;
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    // each 128-bit lane L: the lane-L sums of x[0..3]
    r[q] = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
  }
  const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x44),
                                   _mm512_shuffle_f32x4(r[0], r[1], 0xEE));
  const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(r[2], r[3], 0x44),
                                   _mm512_shuffle_f32x4(r[2], r[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88), _mm512_shuffle_f32x4(v01, v23, 0xDD));
}
#endif

// Ask for one head's row of each of `count` slots ahead of use.
template <typename T>
inline void prefetch_rows(const T* cache, const int64_t* slots, int64_t count, int64_t row,
                          int64_t offset, int64_t bytes) {
  for (int64_t k = 0; k < count; ++k) {
    const char* p = reinterpret_cast<const char*>(cache + slots[k] * row + offset);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  }
}

// Ask for the rows of keys [i, i + count) of a pass over `cache` (head offset `at`) of n keys,
// or past its end for those of the pass that follows over `then` (head offset `then_at`), if
// any. (Always inlined: a call inside the value loop would spill its register-held sums.)
template <typename T>
__attribute__((always_inline)) inline void ask_rows(const T* cache, int64_t at, const T* then,
                                                    int64_t then_at, const int64_t* slots,
                                                    int64_t n, int64_t i, int64_t count,
                                                    int64_t row, int64_t bytes) {
  if (i < n)
    prefetch_rows(cache, slots + i, std::min(count, n - i), row, at, bytes);
  else if (then != nullptr && i - n < n)
    prefetch_rows(then, slots + i - n, std::min(count, 2 * n - i), row, then_at, bytes);
}

// Per-thread scratch: fp32 queries and accumulators, scores, and one group of widened rows.
struct Scratch {
  std::vector<float> buf;
  std::vector<int64_t> slots;
};

#if defined(__AVX512F__)
// The g query heads of K/V head h against keys `slots[0, n)`: C = ceil(head_dim / 16)
// vectors per head row, the last one masked.
template <typename T, int C>
void attend_head(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, int64_t n,
                 int64_t h, bool first, bool last, const Shape& s, float* scratch, T* out) {
  const int64_t g = s.group, hd = s.head_dim, row = s.num_kv_heads * hd, hp = C * kLanes;
  const int64_t np = (n + kKeys - 1) / kKeys * kKeys;
  __mmask16 mask[C];
  for (int c = 0; c < C; ++c) mask[c] = tail_mask(hd - c * kLanes);
  float* qf = scratch;             // [g][hp]
  float* scores = qf + g * hp;     // [g][np]
  float* rows = scores + g * np;   // [kKeys][hp]
  for (int64_t j = 0; j < g; ++j)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(qf + j * hp + c * kLanes,
                       _mm512_mul_ps(load(q + j * hd + c * kLanes, mask[c]), _mm512_set1_ps(s.scale)));
  const int64_t offset = h * hd, bytes = hd * static_cast<int64_t>(sizeof(T));
  // the K rows of the group from i0, widened; rows past the context are zeros
  auto widen = [&](int64_t i0, int64_t m) {
    for (int64_t k = 0; k < kKeys; ++k) {
      const T* src = k_cache + slots[i0 + std::min(k, m - 1)] * row + offset;
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(rows + k * hp + c * kLanes,
                         k < m ? load(src + c * kLanes, mask[c]) : _mm512_setzero_ps());
    }
  };
  if (first) ask_rows<T>(k_cache, offset, nullptr, 0, slots, n, 0, kKeys, row, bytes);
  // scores, and their maximum per query head
  __m512 top[kMaxGroup];
  for (int64_t j = 0; j < g; ++j) top[j] = _mm512_set1_ps(-INFINITY);
  for (int64_t i0 = 0; i0 < n; i0 += kKeys) {
    const int64_t m = std::min(kKeys, n - i0);
    // the next group's rows, or after the last group the first rows of the values' pass
    ask_rows(k_cache, offset, v_cache, offset, slots, n, i0 + kKeys < n ? i0 + kKeys : n, kKeys,
             row, bytes);
    widen(i0, m);
    for (int64_t j = 0; j < g; ++j) {
      __m512 d[kKeys];
      for (int k = 0; k < kKeys; ++k) d[k] = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) {
        const __m512 qc = _mm512_loadu_ps(qf + j * hp + c * kLanes);
        for (int k = 0; k < kKeys; ++k)
          d[k] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(rows + k * hp + c * kLanes), d[k]);
      }
      const __m512 sc = sum16(d);
      _mm512_storeu_ps(scores + j * np + i0, sc);
      top[j] = _mm512_mask_max_ps(top[j], tail_mask(m), top[j], sc);
    }
  }
  // softmax numerators, and their sums
  float total[kMaxGroup];
  for (int64_t j = 0; j < g; ++j) {
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(top[j]));
    __m512 sum = _mm512_setzero_ps();
    float* sj = scores + j * np;
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = tail_mask(n - i);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sj + i), best)));
      _mm512_storeu_ps(sj + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[j] = _mm512_reduce_add_ps(sum);
  }
  // out = the sum over keys of p * v / total, key by key: each V row widened once into
  // registers and taken by up to J query heads at a time, whose sums stay in registers (no
  // widened copy of the rows). Two sums per head, even and odd keys of each group of 16,
  // folded at the group's end: the very order (and bits) of summing a widened group at a
  // time. The row 16 keys on is asked for, and then the next pass's first.
  constexpr int J = C >= 12 ? 1 : 12 / C;
  for (int64_t j0 = 0; j0 < g; j0 += J) {
    const int64_t jn = std::min<int64_t>(J, g - j0);
    __m512 even[J][C], odd[J][C];
    for (int j = 0; j < J; ++j)
      for (int c = 0; c < C; ++c) even[j][c] = _mm512_setzero_ps();
    // one key into the sums `into` (even or odd)
    auto add = [&](__m512 (&into)[J][C], int64_t i) __attribute__((always_inline)) {
      if (j0 == 0)
        ask_rows(v_cache, offset, last ? nullptr : k_cache, offset + hd, slots, n, i + kKeys, 1,
                 row, bytes);
      const T* src = v_cache + slots[i] * row + offset;
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = load(src + c * kLanes, mask[c]);
      for (int j = 0; j < J; ++j) {
        if (j >= jn) break;
        const __m512 pj = _mm512_set1_ps(scores[(j0 + j) * np + i]);
        for (int c = 0; c < C; ++c) into[j][c] = _mm512_fmadd_ps(pj, v[c], into[j][c]);
      }
    };
    for (int64_t i0 = 0; i0 < n; i0 += kKeys) {
      const int64_t m = std::min(kKeys, n - i0);
      for (int j = 0; j < J; ++j)
        for (int c = 0; c < C; ++c) odd[j][c] = _mm512_setzero_ps();
      for (int64_t k = 0; k < m; k += 2) {
        add(even, i0 + k);
        if (k + 1 < m) add(odd, i0 + k + 1);
      }
      for (int j = 0; j < J; ++j)
        for (int c = 0; c < C; ++c) even[j][c] = _mm512_add_ps(even[j][c], odd[j][c]);
    }
    for (int j = 0; j < J; ++j) {
      if (j >= jn) break;
      const __m512 inv = _mm512_set1_ps(1.0f / total[j0 + j]);
      for (int c = 0; c < C; ++c)
        store(out + (j0 + j) * hd + c * kLanes, _mm512_mul_ps(even[j][c], inv), mask[c]);
    }
  }
}
#else
#include "avx2/attention.h"
#endif

// Heads [h0, h1) of one sequence: keys [start, stop) of its context through `blocks`.
// q and out point at the sequence's first query head.
template <typename T, int C>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* blocks, int64_t start,
            int64_t stop, int64_t h0, int64_t h1, const Shape& s, Scratch& scratch, T* out) {
  const int64_t n = stop - start, g = s.group, hp = C * kLanes;
  const int64_t np = (n + kKeys - 1) / kKeys * kKeys;
  // every key's cache slot, walking the block table once (no division per key)
  std::vector<int64_t>& slots = scratch.slots;
  slots.resize(n);
  for (int64_t t = start, i = 0; t < stop; ++i) {
    const int64_t first = t % s.block_size, count = std::min(s.block_size - first, stop - t);
    const int64_t slot = blocks[t / s.block_size] * s.block_size + first;
    for (int64_t j = 0; j < count; ++j) slots[i + j] = slot + j;
    t += count;
    i += count - 1;
  }
  scratch.buf.resize(2 * g * hp + g * np + kKeys * hp);
  for (int64_t h = h0; h < h1; ++h)
    attend_head<T, C>(q + h * g * s.head_dim, k_cache, v_cache, slots.data(), n, h, h == h0,
                      h + 1 == h1, s, scratch.buf.data(), out + h * g * s.head_dim);
}

#if defined(__AVX512F__)
// f(std::integral_constant<int, C>{}) for the C that covers head_dim (C = 16 above 128)
template <typename F>
void dispatch_chunks(int64_t head_dim, F&& f) {
  switch ((head_dim + kLanes - 1) / kLanes) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: f(std::integral_constant<int, 16>{}); break;
  }
}
#endif

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& context_lens, float scale,
         int64_t window, const torch::Tensor& out) {
  const int64_t D = q.size(0), nh = q.size(1), hd = q.size(2);
  const Shape s{k_cache.size(1), k_cache.size(2), nh / k_cache.size(2), hd, scale};
  const int64_t width = block_tables.size(1);
  // NOTE: a task takes all K/V heads of a sequence (each block one contiguous run) when
  // there are enough sequences to keep every thread busy, else one K/V head.
  const int64_t per_task = D >= 2 * at::get_num_threads() ? s.num_kv_heads : 1;
  const int64_t splits = s.num_kv_heads / per_task;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  dispatch_chunks(hd, [&](auto chunks) {
    constexpr int C = decltype(chunks)::value;
    parallel_tasks(D * splits, [&](int64_t task) {
      thread_local Scratch scratch;
      const int64_t d = task / splits, h0 = (task % splits) * per_task;
      const int64_t stop = lens[d];
      const int64_t start = window >= 0 ? std::max<int64_t>(0, stop - window) : 0;
      attend<T, C>(qp + d * q.stride(0), kp, vp, bt + d * width, start, stop, h0, h0 + per_task,
                   s, scratch, op + d * nh * hd);
    });
  });
}

}  // namespace

void decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                      const torch::Tensor& context_lens, double scale, int64_t window,
                      const torch::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() &&
                  out.sizes() == q.sizes(),
              "q must be (D, nh, hd) with contiguous heads (any row stride), out contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(),
              "caches must be contiguous (num_blocks, block_size, nkv, hd)");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0 &&
                  q.size(1) / k_cache.size(2) <= kMaxGroup,
              "head shapes of q and the caches disagree");
  TORCH_CHECK(q.size(2) <= 256, "decode_attention supports head sizes up to 256, not ", q.size(2));
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous() &&
                  context_lens.scalar_type() == torch::kInt64 && context_lens.is_contiguous() &&
                  block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "block_tables (D, nb) and context_lens (D,) must be contiguous int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, caches and out must share a dtype");
  dispatch(q.scalar_type(), "decode_attention", [&](auto t) {
    run<decltype(t)>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  });
}

}  // namespace carousel
