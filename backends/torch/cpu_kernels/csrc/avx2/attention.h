// decode_attention.cpp's per-head kernel with AVX2 (included by decode_attention.cpp inside
// its namespace, in place of the AVX-512 one): groups of 8 keys (kKeys = kLanes), one
// transposing sum per query head and group, the same softmax and value sums.
#pragma once

// lane k: the sum of the lanes of d[k]
inline __m256 sum8(const __m256* d) {
  const __m256 t0 = _mm256_hadd_ps(d[0], d[1]), t1 = _mm256_hadd_ps(d[2], d[3]);
  const __m256 t2 = _mm256_hadd_ps(d[4], d[5]), t3 = _mm256_hadd_ps(d[6], d[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = (d0 d1 d2 d3 | d0 d1 d2 d3) halves' partial sums, u1 likewise for d4..d7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The g query heads of K/V head h against keys `slots[0, n)`: C = ceil(head_dim / 8)
// vectors per head row, the last one partial.
template <typename T, int C>
void attend_head(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, int64_t n,
                 int64_t h, bool /*first*/, bool /*last*/, const Shape& s, float* scratch,
                 T* out) {
  const int64_t g = s.group, hd = s.head_dim, row = s.num_kv_heads * hd, hp = C * kLanes;
  const int64_t np = (n + kKeys - 1) / kKeys * kKeys;
  float* qf = scratch;             // [g][hp]
  float* scores = qf + g * hp;     // [g][np]
  float* rows = scores + g * np;   // [kKeys][hp]
  float* acc = rows + kKeys * hp;  // [g][hp]
  for (int64_t j = 0; j < g; ++j)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_ps(qf + j * hp + c * kLanes,
                       _mm256_mul_ps(load(q + j * hd + c * kLanes, hd - c * kLanes),
                                     _mm256_set1_ps(s.scale)));
  const int64_t offset = h * hd, bytes = hd * static_cast<int64_t>(sizeof(T));
  // the rows of one group, widened; rows past the context are zeros
  auto widen_rows = [&](const T* cache, int64_t i0, int64_t m) {
    for (int64_t k = 0; k < kKeys; ++k) {
      const T* src = cache + slots[i0 + std::min(k, m - 1)] * row + offset;
      for (int c = 0; c < C; ++c)
        _mm256_storeu_ps(rows + k * hp + c * kLanes,
                         k < m ? load(src + c * kLanes, hd - c * kLanes) : _mm256_setzero_ps());
    }
  };
  auto each_group = [&](const T* cache, auto&& body) {
    prefetch_rows(cache, slots, std::min(n, kKeys), row, offset, bytes);
    for (int64_t i0 = 0; i0 < n; i0 += kKeys) {
      const int64_t m = std::min(kKeys, n - i0);
      if (i0 + kKeys < n)
        prefetch_rows(cache, slots + i0 + kKeys, std::min(kKeys, n - i0 - kKeys), row, offset, bytes);
      widen_rows(cache, i0, m);
      body(i0, m);
    }
  };
  // scores, and their maximum per query head
  __m256 top[kMaxGroup];
  for (int64_t j = 0; j < g; ++j) top[j] = _mm256_set1_ps(-INFINITY);
  each_group(k_cache, [&](int64_t i0, int64_t m) {
    for (int64_t j = 0; j < g; ++j) {
      __m256 d[kKeys];
      for (int k = 0; k < kKeys; ++k) d[k] = _mm256_setzero_ps();
      for (int c = 0; c < C; ++c) {
        const __m256 qc = _mm256_loadu_ps(qf + j * hp + c * kLanes);
        for (int k = 0; k < kKeys; ++k)
          d[k] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows + k * hp + c * kLanes), d[k]);
      }
      const __m256 sc = sum8(d);
      _mm256_storeu_ps(scores + j * np + i0, sc);
      top[j] = _mm256_blendv_ps(top[j], _mm256_max_ps(top[j], sc),
                                _mm256_castsi256_ps(lane_mask(m)));
    }
  });
  // softmax numerators (zero past the context), and their sums
  float total[kMaxGroup];
  for (int64_t j = 0; j < g; ++j) {
    const __m256 best = _mm256_set1_ps(reduce_max(top[j]));
    __m256 sum = _mm256_setzero_ps();
    float* sj = scores + j * np;
    for (int64_t i = 0; i < np; i += kLanes) {
      const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sj + i), best)),
                                     _mm256_castsi256_ps(lane_mask(n - i)));
      _mm256_storeu_ps(sj + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    total[j] = reduce_add(sum);
  }
  // acc = the sum over keys of p * v
  for (int64_t j = 0; j < g; ++j)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + j * hp + c * kLanes, _mm256_setzero_ps());
  each_group(v_cache, [&](int64_t i0, int64_t) {
    for (int64_t j = 0; j < g; ++j) {
      const float* p = scores + j * np + i0;
      __m256 a[C];
      for (int c = 0; c < C; ++c) a[c] = _mm256_loadu_ps(acc + j * hp + c * kLanes);
      for (int k = 0; k < kKeys; ++k) {
        const __m256 pk = _mm256_set1_ps(p[k]);
        for (int c = 0; c < C; ++c)
          a[c] = _mm256_fmadd_ps(pk, _mm256_loadu_ps(rows + k * hp + c * kLanes), a[c]);
      }
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + j * hp + c * kLanes, a[c]);
    }
  });
  for (int64_t j = 0; j < g; ++j) {
    const __m256 inv = _mm256_set1_ps(1.0f / total[j]);
    for (int c = 0; c < C; ++c)
      store(out + j * hd + c * kLanes, _mm256_mul_ps(_mm256_loadu_ps(acc + j * hp + c * kLanes), inv),
            hd - c * kLanes);
  }
}

// f(std::integral_constant<int, C>{}) for the C that covers head_dim (C = 32 above 128)
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
    case 12: f(std::integral_constant<int, 12>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    default: f(std::integral_constant<int, 32>{}); break;
  }
}
