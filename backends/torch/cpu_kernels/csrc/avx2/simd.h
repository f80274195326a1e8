// AVX2 helpers (8-lane fp32 vectors), for CPUs without AVX-512: included by ../simd.h in place
// of its AVX-512 ones. A tail is a lane count n (lanes [0, n) valid, the rest zero on load),
// since AVX2 has no 16-bit masked loads. bf16 is widened exactly and narrowed
// round-to-nearest-even, NaN to 0x7FC0, as c10::BFloat16 does.
#pragma once

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace carousel {

constexpr int kLanes = 8;

// the tail of a vector that starts n lanes before the end: its lane count (the AVX-512
// helpers' masks); load and store clamp it to [0, 8]
inline int64_t tail_mask(int64_t n) { return n; }

// lanes [0, n) all ones (n clamped to [0, 8])
inline __m256i lane_mask(int64_t n) {
  static const int32_t ones_then_zeros[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                              0,  0,  0,  0,  0,  0,  0,  0};
  const int64_t c = std::clamp<int64_t>(n, 0, kLanes);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones_then_zeros + kLanes - c));
}

inline __m256 widen(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// v as 8 bf16 (round to nearest even; NaN as torch's 0x7FC0)
inline __m128i narrow(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // 32 -> 16 bits within each 128-bit half, then the two halves' low quarters together
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(packed);
}

inline __m256 load(const float* p, int64_t n) {
  return n >= kLanes ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(n));
}

inline __m256 load(const at::BFloat16* p, int64_t n) {
  if (n >= kLanes) return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  uint16_t part[kLanes] = {};
  if (n > 0) std::memcpy(part, p, n * sizeof(uint16_t));
  return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(part)));
}

inline void store(float* p, __m256 v, int64_t n) {
  if (n >= kLanes)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, lane_mask(n), v);
}

inline void store(at::BFloat16* p, __m256 v, int64_t n) {
  const __m128i h = narrow(v);
  if (n >= kLanes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  } else if (n > 0) {
    uint16_t part[kLanes];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(part), h);
    std::memcpy(p, part, n * sizeof(uint16_t));
  }
}

// v rounded to the element type of the pointer and widened back (fp32: v itself)
inline __m256 round_to(__m256 v, const float*) { return v; }
inline __m256 round_to(__m256 v, const at::BFloat16*) { return widen(narrow(v)); }

inline float reduce_add(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float reduce_max(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// e^x (x clamped to [-87, 88]): 2^n * 2^f as the AVX-512 exp_ps, 2^n built in the exponent
// field (n lies in [-126, 127] there, so it is always a normal number)
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  static const float c[] = {1.0f,
                            0.693147180559945f,
                            0.240226506959101f,
                            0.0555041086648216f,
                            0.00961812910762848f,
                            0.00133335581464284f,
                            0.000154035303933816f,
                            1.52527338040598e-05f};
  __m256 p = _mm256_set1_ps(c[7]);
  for (int i = 6; i >= 0; --i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[i]));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// T(T(silu(g)) * u), as the AVX-512 silu_mul_vec
template <typename T>
inline __m256 silu_mul_vec(__m256 g, __m256 u, const T* like) {
  const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(round_to(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), like), u);
}

}  // namespace carousel
