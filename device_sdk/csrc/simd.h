// SIMD primitives shared by the ElasticLinear op and the decoder: fp32 and fp16 weight runs
// read into fp32 registers, multiplied and summed in fp32 (block-quantised weights: quant.h).
//
//   gemv_rows(x, w, K, begin, end, y)        y[n] = Σ_k x[k]·w[n·K + k], rows [begin, end)
//   gemv_columns(x, w, N, K, begin, end, y)  y[n] = Σ_{k<K} x[k]·w[k·N + n], n in [begin, end)
//   dot(x, w, K), axpy(a, w, y, n)           one dot product; y[0:n] += a · w[0:n]
//
// AVX-512 and AVX2 have explicit paths (GCC 12 keeps AVX-512 loops at 256 bits on CPUs it
// does not know); anything else runs plain loops that the compiler vectorizes as it can.

#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace elastic {

#if defined(__AVX512F__)
struct Simd {
  static constexpr int64_t lanes = 16;
  using reg = __m512;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float v) { return _mm512_set1_ps(v); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static float sum(reg v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Simd {
  static constexpr int64_t lanes = 8;
  using reg = __m256;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static float sum(reg v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#else
struct Simd {  // one lane: plain scalar code
  static constexpr int64_t lanes = 1;
  using reg = float;
  static reg zero() { return 0.0f; }
  static reg set1(float v) { return v; }
  template <typename T>
  static reg load(const T* p) { return static_cast<float>(*p); }
  static reg fma(reg a, reg b, reg c) { return a * b + c; }
  static void store(float* p, reg v) { *p = v; }
  static float sum(reg v) { return v; }
};
#endif

template <typename T>
inline void axpy(float a, const T* w, float* y, int64_t n) {
  const Simd::reg av = Simd::set1(a);
  int64_t i = 0;
  for (; i + Simd::lanes <= n; i += Simd::lanes) Simd::store(y + i, Simd::fma(av, Simd::load(w + i), Simd::load(y + i)));
  for (; i < n; ++i) y[i] += a * static_cast<float>(w[i]);
}

// How many weight streams to read at once. Measured on Zen 5 (AVX-512, 1 thread): weights
// that need converting (fp16, and the per-channel int8 there was) stream fastest one row at a
// time with four accumulators (~30 GB/s; two to four rows at once fell to 11-17 GB/s), fp32
// four rows at a time, and fp32 column updates eight input rows per pass over y (one for fp16).
template <typename T>
struct Streams {
  static constexpr int rows = 1, unroll = 4, column_rows = 1;
};
template <>
struct Streams<float> {
  static constexpr int rows = 4, unroll = 2, column_rows = 8;
};

// out[r] = Σ_k x[k]·w[r·stride + k] for R rows, U independent accumulators per row.
template <int R, int U, typename T>
inline void dot_rows(const float* x, const T* w, int64_t stride, int64_t K, float* out) {
  Simd::reg acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = Simd::zero();
  constexpr int64_t step = Simd::lanes * U;
  int64_t k = 0;
  for (; k + step <= K; k += step)
    for (int u = 0; u < U; ++u) {
      const Simd::reg xv = Simd::load(x + k + u * Simd::lanes);
      for (int r = 0; r < R; ++r) acc[r][u] = Simd::fma(xv, Simd::load(w + r * stride + k + u * Simd::lanes), acc[r][u]);
    }
  for (; k + Simd::lanes <= K; k += Simd::lanes) {
    const Simd::reg xv = Simd::load(x + k);
    for (int r = 0; r < R; ++r) acc[r][0] = Simd::fma(xv, Simd::load(w + r * stride + k), acc[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    float total = 0;
    for (int u = 0; u < U; ++u) total += Simd::sum(acc[r][u]);
    for (int64_t kk = k; kk < K; ++kk) total += x[kk] * static_cast<float>(w[r * stride + kk]);
    out[r] = total;
  }
}

// One dot product of length K.
template <typename T>
inline float dot(const float* x, const T* w, int64_t K) {
  float out;
  dot_rows<1, Streams<T>::unroll>(x, w, K, K, &out);
  return out;
}

// y[n] = Σ_k x[k]·w[n·K + k] for n in [begin, end): rows of a row-major [*, K] matrix.
template <typename T>
inline void gemv_rows(const float* x, const T* w, int64_t K, int64_t begin, int64_t end, float* y) {
  constexpr int R = Streams<T>::rows, U = Streams<T>::unroll;
  int64_t n = begin;
  for (; n + R <= end; n += R) dot_rows<R, U>(x, w + n * K, K, K, y + n);
  for (; n < end; ++n) dot_rows<1, U>(x, w + n * K, K, K, y + n);
}

// y[begin:end] = Σ_{k<K} x[k]·w[k·N + begin : k·N + end]: the transposed storage of o/down,
// read row after row, KB input rows folded into each pass over y.
template <typename T>
inline void gemv_columns(const float* x, const T* w, int64_t N, int64_t K, int64_t begin, int64_t end, float* y) {
  constexpr int KB = Streams<T>::column_rows;
  const int64_t width = end - begin;
  std::fill(y + begin, y + end, 0.0f);
  int64_t k = 0;
  for (; k + KB <= K; k += KB) {
    Simd::reg a[KB];
    for (int j = 0; j < KB; ++j) a[j] = Simd::set1(x[k + j]);
    const T* rows = w + k * N + begin;
    int64_t n = 0;
    for (; n + Simd::lanes <= width; n += Simd::lanes) {
      Simd::reg acc = Simd::load(y + begin + n);
      for (int j = 0; j < KB; ++j) acc = Simd::fma(a[j], Simd::load(rows + j * N + n), acc);
      Simd::store(y + begin + n, acc);
    }
    for (; n < width; ++n)
      for (int j = 0; j < KB; ++j) y[begin + n] += x[k + j] * static_cast<float>(rows[j * N + n]);
  }
  for (; k < K; ++k) axpy(x[k], w + k * N + begin, y + begin, width);
}

}  // namespace elastic
