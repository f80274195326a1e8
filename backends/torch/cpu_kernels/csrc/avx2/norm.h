// norm.cpp's row kernel with AVX2 (included by norm.cpp inside its namespace, in place of
// the AVX-512 one): the same formula and rounding points.
#pragma once

// one row: optionally h = T(h + d) first; then out = w * T(h * rsqrt(mean(h^2) + eps))
template <typename T>
void norm_row(T* h, const T* d, const T* w, float eps, int64_t H, T* out) {
  __m256 sq = _mm256_setzero_ps();
  for (int64_t i = 0; i < H; i += kLanes) {
    const int64_t m = H - i;
    __m256 x = load(h + i, m);
    if (d != nullptr) {
      x = round_to(_mm256_add_ps(x, load(d + i, m)), h);
      store(h + i, x, m);
    }
    sq = _mm256_fmadd_ps(x, x, sq);
  }
  const float inv = 1.0f / std::sqrt(reduce_add(sq) / static_cast<float>(H) + eps);
  const __m256 scale = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < H; i += kLanes) {
    const int64_t m = H - i;
    const __m256 y = round_to(_mm256_mul_ps(load(h + i, m), scale), h);
    store(out + i, _mm256_mul_ps(load(w + i, m), y), m);
  }
}
