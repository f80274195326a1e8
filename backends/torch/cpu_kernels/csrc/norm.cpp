// The per-token elementwise work of a decoder layer, one pass over each row instead of one
// torch op (and one temporary tensor) per step of the formula.
//
// Each kernel rounds exactly where Hugging Face's modules round, so it computes what they do
// up to the order of fp32 sums:
//   rms_norm:      y = w * T(x * rsqrt(mean(x^2) + eps))             (LlamaRMSNorm and kin)
//   add_rms_norm:  h = T(h + d); then rms_norm(h), h updated in place (the residual stream)
//   silu_mul:      T(T(silu(g)) * u)                                  (act_fn(gate) * up)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

#include "kernels.h"
#include "simd.h"

namespace carousel {
namespace {

#if defined(__AVX512F__)
// one row: optionally h = T(h + d) first; then out = w * T(h * rsqrt(mean(h^2) + eps))
template <typename T>
void norm_row(T* h, const T* d, const T* w, float eps, int64_t H, T* out) {
  __m512 sq = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += kLanes) {
    const __mmask16 m = tail_mask(H - i);
    __m512 x = load(h + i, m);
    if (d != nullptr) {
      x = round_to(_mm512_add_ps(x, load(d + i, m)), h);
      store(h + i, x, m);
    }
    sq = _mm512_fmadd_ps(x, x, sq);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(H) + eps);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < H; i += kLanes) {
    const __mmask16 m = tail_mask(H - i);
    const __m512 y = round_to(_mm512_mul_ps(load(h + i, m), scale), h);
    store(out + i, _mm512_mul_ps(load(w + i, m), y), m);
  }
}
#else
#include "avx2/norm.h"
#endif

template <typename T>
void norm_rows(const torch::Tensor& h, const torch::Tensor* d, const torch::Tensor& w,
               double eps, const torch::Tensor& out) {
  const int64_t rows = h.size(0), H = h.size(1);
  T* hp = h.data_ptr<T>();
  const T* dp = d != nullptr ? d->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row<T>(hp + r * H, dp != nullptr ? dp + r * H : nullptr, wp, static_cast<float>(eps),
                  H, op + r * H);
  });
}

void check_rows(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.sizes() == like.sizes() &&
                  t.scalar_type() == like.scalar_type(),
              name, " must be a contiguous matrix of the shape and dtype of the first input");
}

torch::Tensor norm(const torch::Tensor& h, const torch::Tensor* d, const torch::Tensor& w,
                   double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "hidden must be a contiguous (N, H) matrix");
  if (d != nullptr) check_rows(*d, h, "the residual delta");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == h.size(1) &&
                  w.scalar_type() == h.scalar_type(),
              "weight must be contiguous (H,) in the dtype of hidden");
  auto out = torch::empty_like(h);
  dispatch(h.scalar_type(), "rms_norm",
           [&](auto t) { norm_rows<decltype(t)>(h, d, w, eps, out); });
  return out;
}

template <typename T>
void silu_mul_rows(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& out) {
  const int64_t n = g.numel();
  const T* gp = g.data_ptr<T>();
  const T* up = u.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, (n + kLanes - 1) / kLanes, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t i = c * kLanes;
      const auto m = tail_mask(n - i);
      store(op + i, silu_mul_vec(load(gp + i, m), load(up + i, m), op), m);
    }
  });
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return norm(x, nullptr, weight, eps);
}

torch::Tensor add_rms_norm(const torch::Tensor& hidden, const torch::Tensor& delta,
                           const torch::Tensor& weight, double eps) {
  return norm(hidden, &delta, weight, eps);
}

torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  TORCH_CHECK(gate.is_contiguous(), "gate must be contiguous");
  check_rows(up, gate, "up");
  auto out = torch::empty_like(gate);
  dispatch(gate.scalar_type(), "silu_mul",
           [&](auto t) { silu_mul_rows<decltype(t)>(gate, up, out); });
  return out;
}

}  // namespace carousel
