// Rotary embedding of a layer's fused Q/K projection, in place, and the new K/V written into
// the paged cache: one pass over each token instead of eight torch ops per layer.
//
// Rounds where `x * cos + rotate_half(x) * sin` rounds in HF (each product, then the sum,
// rounded to T), with no fused multiply-add (built with -ffp-contract=off), so fp32 and bf16
// both give the same bits as torch's elementwise ops.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels.h"
#include "simd.h"

namespace carousel {
namespace {

#if defined(__AVX512F__)
// heads [0, heads) of one token's row, each rotated in place
template <typename T>
void rotate_heads(T* row, const T* cos, const T* sin, int64_t heads, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < heads; ++j) {
    T* x = row + j * hd;
    for (int64_t i = 0; i < half; i += kLanes) {
      const __mmask16 m = tail_mask(half - i);
      const __m512 lo = load(x + i, m), hi = load(x + half + i, m);
      const __m512 c_lo = load(cos + i, m), c_hi = load(cos + half + i, m);
      const __m512 s_lo = load(sin + i, m), s_hi = load(sin + half + i, m);
      // rotate_half(x) = (-hi, lo)
      const __m512 neg_hi = _mm512_sub_ps(_mm512_setzero_ps(), hi);
      const __m512 out_lo = _mm512_add_ps(round_to(_mm512_mul_ps(lo, c_lo), x),
                                          round_to(_mm512_mul_ps(neg_hi, s_lo), x));
      const __m512 out_hi = _mm512_add_ps(round_to(_mm512_mul_ps(hi, c_hi), x),
                                          round_to(_mm512_mul_ps(lo, s_hi), x));
      store(x + i, out_lo, m);
      store(x + half + i, out_hi, m);
    }
  }
}
#else
#include "avx2/rotary.h"
#endif

template <typename T>
void run(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
         const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
         int64_t num_heads, int64_t num_kv_heads) {
  const int64_t n = qkv.size(0), width = qkv.size(1), hd = k_cache.size(3);
  T* qp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* kp = k_cache.data_ptr<T>();
  T* vp = v_cache.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t kv_row = num_kv_heads * hd;
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qp + t * width;
      rotate_heads<T>(row, cp + t * cos.stride(0), sp + t * sin.stride(0),
                      num_heads + num_kv_heads, hd);
      std::memcpy(kp + slot[t] * kv_row, row + num_heads * hd, kv_row * sizeof(T));
      std::memcpy(vp + slot[t] * kv_row, row + (num_heads + num_kv_heads) * hd,
                  kv_row * sizeof(T));
    }
  });
}

#if defined(__AVX512F__)
template <typename T>
void argmax_rows(const torch::Tensor& x, const torch::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * x.stride(0);
      // per lane: the largest value and the first index holding it
      __m512 best = _mm512_set1_ps(-INFINITY);
      __m512i where = _mm512_set1_epi32(0);
      __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i step = _mm512_set1_epi32(kLanes);
      bool nan = false;
      for (int64_t i = 0; i < n; i += kLanes) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m, load(row + i, m));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, gt, v);
        where = _mm512_mask_mov_epi32(where, gt, index);
        index = _mm512_add_epi32(index, step);
      }
      alignas(64) float values[kLanes];
      alignas(64) int32_t indices[kLanes];
      _mm512_store_ps(values, best);
      _mm512_store_si512(indices, where);
      int64_t arg = indices[0];
      float top = values[0];
      for (int l = 1; l < kLanes; ++l)
        if (values[l] > top || (values[l] == top && indices[l] < arg)) {
          top = values[l];
          arg = indices[l];
        }
      if (nan) {  // torch.argmax: a NaN is the maximum (its first index)
        for (int64_t i = 0; i < n; ++i)
          if (std::isnan(static_cast<float>(row[i]))) {
            arg = i;
            break;
          }
      }
      op[r] = arg;
    }
  });
}
#endif

}  // namespace

void rotary_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                     const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const torch::Tensor& slots, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be a contiguous (N, width) matrix");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == num_kv_heads,
              "caches must be contiguous (num_blocks, block_size, nkv, hd)");
  const int64_t hd = k_cache.size(3);
  TORCH_CHECK(hd % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * hd,
              "qkv's width must be (num_heads + 2 num_kv_heads) head_dim, head_dim even");
  for (const torch::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == qkv.size(0) && t->size(1) == hd &&
                    t->stride(1) == 1,
                "cos and sin must be (N, head_dim) with unit stride along head_dim");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() &&
                  slots.numel() == qkv.size(0),
              "slots must be contiguous int64, one per token");
  for (const torch::Tensor* t : {&cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "qkv, cos, sin and caches share a dtype");
  dispatch(qkv.scalar_type(), "rotary_write_kv", [&](auto t) {
    run<decltype(t)>(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads);
  });
}

torch::Tensor argmax(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "x must be a non-empty (B, V) matrix with unit stride along V");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  dispatch(x.scalar_type(), "argmax", [&](auto t) { argmax_rows<decltype(t)>(x, out); });
  return out;
}

}  // namespace carousel
