// rotary.cpp's rotation and argmax with AVX2 (included by rotary.cpp inside its namespace, in
// place of the AVX-512 ones): the same rounding points, no fused multiply-add.
#pragma once

// heads [0, heads) of one token's row, each rotated in place
template <typename T>
void rotate_heads(T* row, const T* cos, const T* sin, int64_t heads, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < heads; ++j) {
    T* x = row + j * hd;
    for (int64_t i = 0; i < half; i += kLanes) {
      const int64_t m = half - i;
      const __m256 lo = load(x + i, m), hi = load(x + half + i, m);
      const __m256 c_lo = load(cos + i, m), c_hi = load(cos + half + i, m);
      const __m256 s_lo = load(sin + i, m), s_hi = load(sin + half + i, m);
      // rotate_half(x) = (-hi, lo)
      const __m256 neg_hi = _mm256_sub_ps(_mm256_setzero_ps(), hi);
      const __m256 out_lo = _mm256_add_ps(round_to(_mm256_mul_ps(lo, c_lo), x),
                                          round_to(_mm256_mul_ps(neg_hi, s_lo), x));
      const __m256 out_hi = _mm256_add_ps(round_to(_mm256_mul_ps(hi, c_hi), x),
                                          round_to(_mm256_mul_ps(lo, s_hi), x));
      store(x + i, out_lo, m);
      store(x + half + i, out_hi, m);
    }
  }
}

template <typename T>
void argmax_rows(const torch::Tensor& x, const torch::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * x.stride(0);
      // per lane: the largest value and the first index holding it
      __m256 best = _mm256_set1_ps(-INFINITY);
      __m256i where = _mm256_setzero_si256();
      __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i step = _mm256_set1_epi32(kLanes);
      __m256 nan = _mm256_setzero_ps();
      for (int64_t i = 0; i < n; i += kLanes) {
        const int64_t m = n - i;
        __m256 v = load(row + i, m);
        if (m < kLanes)  // lanes past the row: -inf, never the maximum
          v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v,
                               _mm256_castsi256_ps(lane_mask(m)));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
        best = _mm256_blendv_ps(best, v, gt);
        where = _mm256_blendv_epi8(where, index, _mm256_castps_si256(gt));
        index = _mm256_add_epi32(index, step);
      }
      alignas(32) float values[kLanes];
      alignas(32) int32_t indices[kLanes];
      _mm256_store_ps(values, best);
      _mm256_store_si256(reinterpret_cast<__m256i*>(indices), where);
      int64_t arg = indices[0];
      float top = values[0];
      for (int l = 1; l < kLanes; ++l)
        if (values[l] > top || (values[l] == top && indices[l] < arg)) {
          top = values[l];
          arg = indices[l];
        }
      if (_mm256_movemask_ps(nan) != 0) {  // torch.argmax: a NaN is the maximum (its first index)
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
