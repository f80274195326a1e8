// Decode attention that reads K/V in place from the paged cache.
//
// One task per sequence (all its K/V heads: each cache slot is read as one run), or per
// (sequence, K/V head) when there are too few sequences to keep every thread busy. A task
// scores its query heads against every key of the context (the g query heads of a K/V head
// together, so each K and V row is read once), softmaxes, and sums the values. The slots are
// listed once from the block table and each row is prefetched a few keys ahead (blocks are
// scattered: the hardware prefetcher cannot follow). fp32 math throughout (bf16 widened).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace carousel {
namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per K/V head

struct Shape {
  int64_t block_size, num_kv_heads, group, head_dim;
  float scale;
};

constexpr int64_t kAhead = 8;  // keys between a row's prefetch and its use

// Ask for heads [h0, h1) of one cache slot ahead of use.
template <typename T>
inline void prefetch_row(const T* slot, int64_t h0, int64_t h1, int64_t hd) {
  const char* from = reinterpret_cast<const char*>(slot + h0 * hd);
  const char* to = reinterpret_cast<const char*>(slot + h1 * hd);
  for (const char* p = from; p < to; p += 64) _mm_prefetch(p, _MM_HINT_T0);
}

// Heads [h0, h1) of one sequence: keys [start, stop) of its context through `blocks`.
// q and out point at the sequence's first query head; the caches at its slot rows.
template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* blocks, int64_t start,
            int64_t stop, int64_t h0, int64_t h1, const Shape& s, std::vector<float>& buf,
            std::vector<int64_t>& slot_buf, T* out) {
  const int64_t n = stop - start, g = s.group, hd = s.head_dim;
  const int64_t chunks = (hd + kLanes - 1) / kLanes;
  const int64_t hp = chunks * kLanes;  // head stride in buf: whole vectors, zero tail lanes
  const int64_t heads = (h1 - h0) * g;  // query heads of this task
  // buf: [heads][hp] scaled fp32 queries, [heads][hp] accumulators, [heads][n] scores
  buf.resize(2 * heads * hp + heads * n);
  float* qf = buf.data();
  float* acc = qf + heads * hp;
  float* scores = acc + heads * hp;
  for (int64_t j = 0; j < heads; ++j)
    for (int64_t c = 0; c < chunks; ++c) {
      const __mmask16 m = tail_mask(hd - c * kLanes);
      const __m512 v = load(q + (h0 * g + j) * hd + c * kLanes, m);
      _mm512_storeu_ps(qf + j * hp + c * kLanes, _mm512_mul_ps(v, _mm512_set1_ps(s.scale)));
      _mm512_storeu_ps(acc + j * hp + c * kLanes, _mm512_setzero_ps());
    }
  std::vector<float> best(heads, -INFINITY);
  // every key's cache slot, walking the block table once (no division per key)
  std::vector<int64_t>& slots = slot_buf;
  slots.resize(n);
  for (int64_t t = start, i = 0; t < stop; ++i) {
    const int64_t first = t % s.block_size, count = std::min(s.block_size - first, stop - t);
    const int64_t slot = blocks[t / s.block_size] * s.block_size + first;
    for (int64_t j = 0; j < count; ++j) slots[i + j] = slot + j;
    t += count;
    i += count - 1;
  }
  const int64_t row = s.num_kv_heads * hd;  // elements per cache slot
  // scores = q . k for every key and query head. A task over all K/V heads reads each slot
  // as one run; the rows `kAhead` keys on are asked for ahead of use, since blocks are
  // scattered and the OoO window holds only a few keys' work.
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch_row(k_cache + slots[i + kAhead] * row, h0, h1, hd);
    for (int64_t h = h0; h < h1; ++h) {
      const T* key = k_cache + slots[i] * row + h * hd;
      const float* qh = qf + (h - h0) * g * hp;
      __m512 dot[kMaxGroup];
      for (int64_t j = 0; j < g; ++j) dot[j] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 kv = load(key + c * kLanes, tail_mask(hd - c * kLanes));
        for (int64_t j = 0; j < g; ++j)
          dot[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + j * hp + c * kLanes), kv, dot[j]);
      }
      for (int64_t j = 0; j < g; ++j) {
        const int64_t r = (h - h0) * g + j;
        const float score = _mm512_reduce_add_ps(dot[j]);
        scores[r * n + i] = score;
        best[r] = std::max(best[r], score);
      }
    }
  }
  // softmax numerators, and their sums
  std::vector<float> total(heads);
  for (int64_t r = 0; r < heads; ++r) {
    __m512 sum = _mm512_setzero_ps();
    const __m512 top = _mm512_set1_ps(best[r]);
    float* row = scores + r * n;
    for (int64_t i = 0; i < n; i += kLanes) {
      const __mmask16 m = tail_mask(n - i);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), top));
      _mm512_mask_storeu_ps(row + i, m, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    total[r] = _mm512_reduce_add_ps(sum);
  }
  // acc = the sum over keys of p * v
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch_row(v_cache + slots[i + kAhead] * row, h0, h1, hd);
    for (int64_t h = h0; h < h1; ++h) {
      const T* value = v_cache + slots[i] * row + h * hd;
      float* ah = acc + (h - h0) * g * hp;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 vv = load(value + c * kLanes, tail_mask(hd - c * kLanes));
        for (int64_t j = 0; j < g; ++j) {
          float* a = ah + j * hp + c * kLanes;
          const __m512 p = _mm512_set1_ps(scores[((h - h0) * g + j) * n + i]);
          _mm512_storeu_ps(a, _mm512_fmadd_ps(p, vv, _mm512_loadu_ps(a)));
        }
      }
    }
  }
  for (int64_t r = 0; r < heads; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / total[r]);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(acc + r * hp + c * kLanes), inv);
      store(out + (h0 * g + r) * hd + c * kLanes, o, tail_mask(hd - c * kLanes));
    }
  }
}

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
  at::parallel_for(0, D * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    std::vector<int64_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t d = task / splits, h0 = (task % splits) * per_task;
      const int64_t stop = lens[d];
      const int64_t start = window >= 0 ? std::max<int64_t>(0, stop - window) : 0;
      attend<T>(qp + d * q.stride(0), kp, vp, bt + d * width, start, stop, h0, h0 + per_task, s,
                buf, slots, op + d * nh * hd);
    }
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
