// Integer GEMV over block-quantised weights (device_sdk/quant.py's layout: llama.cpp's Q8_0 and
// Q4_0 blocks of 32 along the reduction dimension, one fp16 scale each).
//
// The input vector is quantised per block of 32 to int8 (fp32 scale, round half to even); then
// every output is Σ_b d_w[b]·d_x[b]·Σ_j q_w[b, j]·q_x[b, j], the inner sum exact in int32.
//
//   Activations::set(x, K, isa)        quantise x[0:K], zero-padded to whole blocks
//   gemv(fmt, w, out_stride, block_stride, x, begin, end, y, isa)
//       y[n] for n in [begin, end), output n's block b at w + n·out_stride + b·block_stride:
//       row units: out_stride = row bytes, block_stride = block bytes;
//       column units: out_stride = block bytes, block_stride = outputs · block bytes.
//
// Instruction sets, all compiled where the build (-march=native) has them and picked at run
// time (`active_isa`, which tests may force down to scalar):
//   SCALAR  plain C++, every machine;
//   AVX2    _mm256_maddubs_epi16 + _mm256_madd_epi16 on |w| and sign(x, w), as llama.cpp;
//   VNNI    the same with one _mm256_dpbusd (AVX-VNNI, or AVX-512 VNNI with VL).

#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ELASTIFY_HAVE_AVX2 1
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define ELASTIFY_HAVE_VNNI 1
#endif
#endif

namespace elastic {
namespace quant {

constexpr int64_t BLOCK = 32;
enum Format : int64_t { NONE = 0, Q8 = 1, Q4 = 2 };
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, VNNI = 2 };

inline int64_t block_bytes(int64_t fmt) { return fmt == Q8 ? 2 + BLOCK : 2 + BLOCK / 2; }
inline int64_t blocks_for(int64_t n) { return (n + BLOCK - 1) / BLOCK; }

// The best instruction set this build has and this CPU runs.
inline int64_t best_isa() {
#if defined(ELASTIFY_HAVE_VNNI)
  if (__builtin_cpu_supports("avx2") && (__builtin_cpu_supports("avxvnni") || __builtin_cpu_supports("avx512vnni")))
    return VNNI;
#endif
#if defined(ELASTIFY_HAVE_AVX2)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
#endif
  return SCALAR;
}

// The instruction set the kernels use: best_isa() unless set lower (set_isa).
inline int64_t& active_isa() {
  static int64_t isa = best_isa();
  return isa;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One input vector quantised per block of 32.
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> d;
  int64_t blocks = 0;

  void set(const float* x, int64_t K, int64_t isa) {
    blocks = blocks_for(K);
    q.resize(blocks * BLOCK);
    d.resize(blocks);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t first = b * BLOCK, count = std::min(BLOCK, K - first);
#if defined(ELASTIFY_HAVE_AVX2)
      if (isa != SCALAR && count == BLOCK) {
        block_avx2(x + first, q.data() + first, d.data() + b);
        continue;
      }
#endif
      float amax = 0;
      for (int64_t j = 0; j < count; ++j) amax = std::max(amax, std::fabs(x[first + j]));
      const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
      d[b] = scale;
      for (int64_t j = 0; j < BLOCK; ++j)
        q[first + j] = j < count ? static_cast<int8_t>(std::nearbyint(x[first + j] * inverse)) : 0;
    }
  }

#if defined(ELASTIFY_HAVE_AVX2)
  static void block_avx2(const float* x, int8_t* out, float* scale_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float scale = _mm_cvtss_f32(m) / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    *scale_out = scale;
    const __m256 mul = _mm256_set1_ps(inverse);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i)
      i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // packs interleave the 128-bit lanes; the permute puts the 32 values back in order.
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
  }
#endif
};

// --- one block's integer dot product, scalar

template <int64_t FMT>
inline int32_t block_dot_scalar(const uint8_t* w, const int8_t* x) {
  int32_t sum = 0;
  if constexpr (FMT == Q8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w + 2);
    for (int j = 0; j < BLOCK; ++j) sum += static_cast<int32_t>(q[j]) * x[j];
  } else {
    const uint8_t* q = w + 2;
    for (int j = 0; j < BLOCK / 2; ++j)
      sum += (static_cast<int32_t>(q[j] & 0x0F) - 8) * x[j] + (static_cast<int32_t>(q[j] >> 4) - 8) * x[j + BLOCK / 2];
  }
  return sum;
}

template <int64_t FMT, int T>
inline void dot_tile_scalar(const uint8_t* w, int64_t out_stride, int64_t block_stride, const Activations& x, float* y) {
  float acc[T] = {};
  for (int64_t b = 0; b < x.blocks; ++b) {
    const int8_t* xq = x.q.data() + b * BLOCK;
    for (int t = 0; t < T; ++t) {
      const uint8_t* block = w + t * out_stride + b * block_stride;
      acc[t] += half_at(block) * x.d[b] * static_cast<float>(block_dot_scalar<FMT>(block, xq));
    }
  }
  for (int t = 0; t < T; ++t) y[t] = acc[t];
}

#if defined(ELASTIFY_HAVE_AVX2)
// --- AVX2 / VNNI: 32 products per block in one register, as eight int32 partial sums

template <int64_t FMT>
inline __m256i load_weights(const uint8_t* w) {
  if constexpr (FMT == Q8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
  } else {  // low nibbles are values 0-15, high nibbles 16-31
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2));
    const __m256i both = _mm256_insertf128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1);
    return _mm256_sub_epi8(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), _mm256_set1_epi8(8));
  }
}

// Eight int32 sums of w·x as floats. maddubs takes unsigned × signed bytes, so |w| × sign(x, w):
// |w| ≤ 127 and |x| ≤ 127, a pair sums to at most 32,258, under int16's saturation.
template <bool Vnni>
inline __m256 products(__m256i w, __m256i x) {
  const __m256i magnitude = _mm256_sign_epi8(w, w), signed_x = _mm256_sign_epi8(x, w);
#if defined(ELASTIFY_HAVE_VNNI)
  if constexpr (Vnni) {
#if defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), magnitude, signed_x));
#else
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, signed_x));
#endif
  }
#endif
  const __m256i pairs = _mm256_maddubs_epi16(magnitude, signed_x);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// How far ahead of each weight block to prefetch: the next rows (row units, whose tiles are
// adjacent in memory) or the next outputs' blocks of the same block-row (column units).
constexpr int64_t kPrefetchBytes = 1024;

template <int64_t FMT, int T, bool Vnni>
inline void dot_tile_simd(const uint8_t* w, int64_t out_stride, int64_t block_stride, const Activations& x, float* y) {
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + b * BLOCK));
    const float dx = x.d[b];
    for (int t = 0; t < T; ++t) {
      const uint8_t* block = w + t * out_stride + b * block_stride;
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes), _MM_HINT_T0);
      uint16_t bits;
      std::memcpy(&bits, block, 2);
      const __m256 scale = _mm256_set1_ps(_cvtsh_ss(bits) * dx);
      acc[t] = _mm256_fmadd_ps(scale, products<Vnni>(load_weights<FMT>(block), xq), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) y[t] = sum8(acc[t]);
}
#endif

template <int64_t FMT, int T>
inline void dot_tile(const uint8_t* w, int64_t out_stride, int64_t block_stride, const Activations& x, float* y,
                     int64_t isa) {
#if defined(ELASTIFY_HAVE_VNNI)
  if (isa == VNNI) return dot_tile_simd<FMT, T, true>(w, out_stride, block_stride, x, y);
#endif
#if defined(ELASTIFY_HAVE_AVX2)
  if (isa != SCALAR) return dot_tile_simd<FMT, T, false>(w, out_stride, block_stride, x, y);
#endif
  dot_tile_scalar<FMT, T>(w, out_stride, block_stride, x, y);
}

// Outputs kTile at a time (each activation block loaded once for them), then one. A rough guide
// only (a 2-core VM shared with other jobs, AVX2, one thread): on a 49152x576 lm_head, int8,
// 4 outputs 6.4 ms, 1 output 3.3, 2 outputs with the prefetch below 2.5; 1536x576 gate/down
// shapes moved less (67-143 us), and 2 with prefetch was among the best there too.
constexpr int kTile = 2;
template <int64_t FMT>
inline void gemv_format(const uint8_t* w, int64_t out_stride, int64_t block_stride, const Activations& x,
                        int64_t begin, int64_t end, float* y, int64_t isa) {
  int64_t n = begin;
  for (; n + kTile <= end; n += kTile) dot_tile<FMT, kTile>(w + n * out_stride, out_stride, block_stride, x, y + n, isa);
  for (; n < end; ++n) dot_tile<FMT, 1>(w + n * out_stride, out_stride, block_stride, x, y + n, isa);
}

inline void gemv(int64_t fmt, const uint8_t* w, int64_t out_stride, int64_t block_stride, const Activations& x,
                 int64_t begin, int64_t end, float* y, int64_t isa) {
  if (fmt == Q8)
    gemv_format<Q8>(w, out_stride, block_stride, x, begin, end, y, isa);
  else
    gemv_format<Q4>(w, out_stride, block_stride, x, begin, end, y, isa);
}

// Row units [rows, in]: y[n], n in [begin, end). Column units [in, out]: y[n] over all active input blocks.
inline void gemv_rows(int64_t fmt, const uint8_t* w, int64_t in, const Activations& x, int64_t begin, int64_t end,
                      float* y, int64_t isa) {
  const int64_t size = block_bytes(fmt);
  gemv(fmt, w, blocks_for(in) * size, size, x, begin, end, y, isa);
}

inline void gemv_columns(int64_t fmt, const uint8_t* w, int64_t out, const Activations& x, int64_t begin, int64_t end,
                         float* y, int64_t isa) {
  const int64_t size = block_bytes(fmt);
  gemv(fmt, w, size, out * size, x, begin, end, y, isa);
}

// Dequantise one block (for the prefill GEMM path).
inline void dequantize_block(int64_t fmt, const uint8_t* w, float* out) {
  const float d = half_at(w);
  if (fmt == Q8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w + 2);
    for (int j = 0; j < BLOCK; ++j) out[j] = d * static_cast<float>(q[j]);
  } else {
    for (int j = 0; j < BLOCK / 2; ++j) {
      out[j] = d * static_cast<float>(static_cast<int>(w[2 + j] & 0x0F) - 8);
      out[j + BLOCK / 2] = d * static_cast<float>(static_cast<int>(w[2 + j] >> 4) - 8);
    }
  }
}

}  // namespace quant
}  // namespace elastic
