// SIMD helpers shared by the kernels: 16-lane fp32 vectors, loaded from and stored to fp32
// or bf16 memory (bf16 widened exactly, narrowed round-to-nearest-even as torch does).
// Built without AVX-512 (an AVX2 CPU), the 8-lane helpers of avx2/simd.h stand in for them,
// and each kernel takes its avx2/ implementation.
#pragma once

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstdint>

namespace carousel {

// f(T{}) with T the element type of `dtype` (float or at::BFloat16), the dtypes every kernel
// computes in; anything else is an error naming the kernel
template <typename F>
void dispatch(at::ScalarType dtype, const char* kernel, F&& f) {
  if (dtype == at::kBFloat16) {
    f(at::BFloat16{});
  } else if (dtype == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(false, kernel, " supports float32 and bfloat16, not ", dtype);
  }
}

}  // namespace carousel

#if !defined(__AVX512F__)
#include "avx2/simd.h"
#else
namespace carousel {

constexpr int kLanes = 16;

// the first n lanes (none for n <= 0, all 16 from n >= 16)
inline __mmask16 tail_mask(int64_t n) {
  if (n <= 0) return 0;
  return n >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }

inline void store(at::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// v rounded to the element type of the pointer and widened back (fp32: v itself): where a
// torch formula holds an intermediate tensor of that dtype
inline __m512 round_to(__m512 v, const float*) { return v; }

inline __m512 round_to(__m512 v, const at::BFloat16*) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e^x (x clamped to [-87, 88]): 2^n * 2^f with |f| <= 1/2, 2^f by its degree-7 Taylor
// polynomial (relative error below 1e-7), 2^n by vscalefps
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  static const float c[] = {1.0f,
                            0.693147180559945f,
                            0.240226506959101f,
                            0.0555041086648216f,
                            0.00961812910762848f,
                            0.00133335581464284f,
                            0.000154035303933816f,
                            1.52527338040598e-05f};
  __m512 p = _mm512_set1_ps(c[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

// T(T(silu(g)) * u) for one vector of gate and up values already in T's precision: the
// MLP's act_fn(gate) * up as torch rounds it (shared by silu_mul and linear_silu_mul)
template <typename T>
inline __m512 silu_mul_vec(__m512 g, __m512 u, const T* like) {
  const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(round_to(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), like), u);
}

}  // namespace carousel
#endif  // __AVX512F__
