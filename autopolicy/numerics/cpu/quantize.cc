// The float ends of the fused dense calls (ffi.cc): rows of float32 or bfloat16 activations
// quantized to int8 before the integer product, and the int32 (or per-block float) sums rescaled
// (plus an optional bias) into float32 or bfloat16 after it. Each does the operations of the
// package's XLA path in the same order and the same float32 rounding, so the outputs are equal
// bit for bit (tests/test_cpu_kernels.py). Plain C++, and an AVX2 quantizer where the CPU has
// AVX2: at batch 1 a few thousand elements a call, far from the cost of the weights' traffic; at
// batch 256 the plain loop (not vectorized: its max and clamps are not reassociable floats) took
// a third of the int8 GEMM's time.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels.h"

#if defined(__x86_64__)
namespace autopolicy_cpu {
void quantize_rows_avx2(const void* x, bool bf16, int64_t m, int64_t k, int8_t* q, float* scale);
void rescale_int8_avx2(const int32_t* acc, int64_t m, int64_t n, const float* x_scale, const float* w_scale,
                       const void* bias, bool bf16, int64_t n0, int64_t n1, void* out);
void rescale_int4_avx2(const float* y, int64_t m, int64_t n, const float* x_scale, const void* bias, bool bf16,
                       int64_t n0, int64_t n1, void* out);
}  // namespace autopolicy_cpu
#endif

namespace autopolicy_cpu {
namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
// a * s + bias[c] as the layer's XLA fusion computes the rescale and the bias add: in float32 it
// contracts them into one fused multiply-add (XLA's CPU compiler allows contraction); in
// bfloat16 the product is rounded to bfloat16 first (the cast between them).
inline float scale_add(float a, float s, const float* bias, int64_t c) { return std::fma(a, s, bias[c]); }
inline float scale_add(float a, float s, const uint16_t* bias, int64_t c) {
  return bf16_to_float(float_to_bf16(a * s)) + bf16_to_float(bias[c]);
}

// Rounds half to even (jnp.round) for |v| < 2^22 under the default rounding mode: v + 1.5 * 2^23
// has no fraction bits left, so the addition itself rounds. Quantized values are within +-128.
inline float round_even(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

template <typename T>
void quantize_rows_as(const T* x, int64_t m, int64_t k, int8_t* q, float* scale) {
  // XLA rewrites quantize_symmetric's amax / 127 into amax * float32(1 / 127): the same here.
  constexpr float kInvMax = 1.0f / 127.0f;
  for (int64_t r = 0; r < m; ++r) {
    const T* row = x + r * k;
    float amax = 0.0f;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(load(row, i)));
    const float s = amax > 0.0f ? amax * kInvMax : 1.0f;  // an all-zero row: scale 1
    const float inv = 1.0f / s;
    for (int64_t i = 0; i < k; ++i) {
      const float v = round_even(load(row, i) * inv);
      q[r * k + i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    }
    scale[r] = s;
  }
}

// out = float(acc) * (x_scale * w_scale) [+ bias], rounded to the output dtype.
template <typename T>
void rescale_int8_as(const int32_t* acc, int64_t m, int64_t n, const float* x_scale, const float* w_scale,
                     const T* bias, int64_t n0, int64_t n1, T* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float xs = x_scale[r];
    for (int64_t c = n0; c < n1; ++c) {
      const float a = static_cast<float>(acc[r * n + c]), s = xs * w_scale[c];
      store(out, r * n + c, bias != nullptr ? scale_add(a, s, bias, c) : a * s);
    }
  }
}

// out = y * x_scale [+ bias]: the per-block float sums of the int4 kernel times the row's scale.
template <typename T>
void rescale_int4_as(const float* y, int64_t m, int64_t n, const float* x_scale, const T* bias, int64_t n0,
                     int64_t n1, T* out) {
  for (int64_t r = 0; r < m; ++r) {
    const float xs = x_scale[r];
    for (int64_t c = n0; c < n1; ++c) {
      const float a = y[r * n + c];
      store(out, r * n + c, bias != nullptr ? scale_add(a, xs, bias, c) : a * xs);
    }
  }
}

// Whether the float ends take their AVX2 loops: on every path but the portable one (each needs
// AVX2 and FMA), which keeps to plain C++ throughout, so the tests of that path check these loops
// against XLA too.
bool simd_ends() {
#if defined(__x86_64__)
  return std::strcmp(current_path().name, "portable") != 0;
#else
  return false;
#endif
}

}  // namespace

void quantize_rows(const void* x, bool bf16, int64_t m, int64_t k, int8_t* q, float* scale) {
#if defined(__x86_64__)
  if (simd_ends()) return quantize_rows_avx2(x, bf16, m, k, q, scale);
#endif
  if (bf16) {
    quantize_rows_as(static_cast<const uint16_t*>(x), m, k, q, scale);
  } else {
    quantize_rows_as(static_cast<const float*>(x), m, k, q, scale);
  }
}

void rescale_int8(const int32_t* acc, int64_t m, int64_t n, const float* x_scale, const float* w_scale,
                  const void* bias, bool bf16, int64_t n0, int64_t n1, void* out) {
#if defined(__x86_64__)
  if (simd_ends()) return rescale_int8_avx2(acc, m, n, x_scale, w_scale, bias, bf16, n0, n1, out);
#endif
  if (bf16) {
    rescale_int8_as(acc, m, n, x_scale, w_scale, static_cast<const uint16_t*>(bias), n0, n1,
                    static_cast<uint16_t*>(out));
  } else {
    rescale_int8_as(acc, m, n, x_scale, w_scale, static_cast<const float*>(bias), n0, n1, static_cast<float*>(out));
  }
}

void rescale_int4(const float* y, int64_t m, int64_t n, const float* x_scale, const void* bias, bool bf16,
                  int64_t n0, int64_t n1, void* out) {
#if defined(__x86_64__)
  if (simd_ends()) return rescale_int4_avx2(y, m, n, x_scale, bias, bf16, n0, n1, out);
#endif
  if (bf16) {
    rescale_int4_as(y, m, n, x_scale, static_cast<const uint16_t*>(bias), n0, n1, static_cast<uint16_t*>(out));
  } else {
    rescale_int4_as(y, m, n, x_scale, static_cast<const float*>(bias), n0, n1, static_cast<float*>(out));
  }
}

}  // namespace autopolicy_cpu

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

namespace autopolicy_cpu {
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// quantize_rows_as, eight values at a time, with the same float operations on each value: the
// maximum of |x| (vmaxps keeps the running maximum where x is NaN, as std::max does; the order
// of a maximum changes nothing), then x * inv rounded half to even by the same additions,
// clamped by vmaxps / vminps exactly as std::max(-127, v) and std::min(127, v) (NaN -> -127).
template <typename T>
void quantize_rows_avx2_as(const T* x, int64_t m, int64_t k, int8_t* q, float* scale) {
  constexpr float kInvMax = 1.0f / 127.0f;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 magic = _mm256_set1_ps(12582912.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int64_t r = 0; r < m; ++r) {
    const T* row = x + r * k;
    __m256 vmax = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(_mm256_and_ps(load8(row + i), abs_mask), vmax);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float amax = 0.0f;
    for (float v : lanes) amax = std::max(amax, v);
    for (; i < k; ++i) amax = std::max(amax, std::fabs(load(row, i)));
    const float s = amax > 0.0f ? amax * kInvMax : 1.0f;  // an all-zero row: scale 1
    const float inv = 1.0f / s;
    const __m256 vinv = _mm256_set1_ps(inv);
    int8_t* out = q + r * k;
    for (i = 0; i + 8 <= k; i += 8) {
      const __m256 v = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(load8(row + i), vinv), magic), magic);
      const __m256i n = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(w, w));
    }
    for (; i < k; ++i) {
      const float v = round_even(load(row, i) * inv);
      out[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
    }
    scale[r] = s;
  }
}

// Eight float32 values to bfloat16 bits (in the low 16 bits of each lane) as float_to_bf16
// rounds them: to nearest even, a NaN to a quiet NaN.
inline __m256i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)),
                       _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1))),
      16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x0040));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

inline __m256 bf16_round_trip(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(to_bf16(v), 16)); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
  const __m256i b = to_bf16(v);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// a * s + bias, as scale_add computes it (float32: one fused multiply-add; bfloat16: the product
// rounded to bfloat16 first, the sum rounded on store).
inline __m256 scale_add8(__m256 a, __m256 s, const float* bias) { return _mm256_fmadd_ps(a, s, load8(bias)); }
inline __m256 scale_add8(__m256 a, __m256 s, const uint16_t* bias) {
  return _mm256_add_ps(bf16_round_trip(_mm256_mul_ps(a, s)), load8(bias));
}

// Columns [n0, n1) of each row of the output in steps of eight: full steps in place, the last
// (fewer than eight) through zero-padded copies, so every value takes the same vector operations.
// scale_of(row, col) gives the eight scales of columns col .. col + 7.
template <typename T, typename Sums, typename Scale>
void rescale_rows_avx2(const Sums* sums, int64_t m, int64_t n, Scale scale_of, const T* bias, int64_t n0,
                       int64_t n1, T* out) {
  for (int64_t r = 0; r < m; ++r) {
    int64_t c = n0;
    auto step = [&](const Sums* a_at, const T* b_at, int64_t col, T* o_at) {
      __m256 a;
      if constexpr (std::is_same_v<Sums, int32_t>) {
        a = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a_at)));
      } else {
        a = _mm256_loadu_ps(a_at);
      }
      const __m256 s = scale_of(r, col);
      store8(o_at, b_at != nullptr ? scale_add8(a, s, b_at) : _mm256_mul_ps(a, s));
    };
    for (; c + 8 <= n1; c += 8) step(sums + r * n + c, bias != nullptr ? bias + c : nullptr, c, out + r * n + c);
    if (c < n1) {
      const int64_t rest = n1 - c;
      Sums a[8] = {};
      T b[8] = {}, o[8] = {};
      std::copy(sums + r * n + c, sums + r * n + n1, a);
      if (bias != nullptr) std::copy(bias + c, bias + n1, b);
      step(a, bias != nullptr ? b : nullptr, c, o);
      std::copy(o, o + rest, out + r * n + c);
    }
  }
}

}  // namespace

void rescale_int8_avx2(const int32_t* acc, int64_t m, int64_t n, const float* x_scale, const float* w_scale,
                       const void* bias, bool bf16, int64_t n0, int64_t n1, void* out) {
  // The scale of each column as the portable loop takes it: x_scale[row] * w_scale[col] (w_scale
  // through a zero-padded copy at a row's last columns).
  float tail[8] = {};
  const int64_t full_end = n0 + (n1 - n0) / 8 * 8;
  std::copy(w_scale + full_end, w_scale + n1, tail);
  auto scale_of = [=, &tail](int64_t r, int64_t c) {
    const __m256 ws = c < full_end ? _mm256_loadu_ps(w_scale + c) : _mm256_loadu_ps(tail);
    return _mm256_mul_ps(_mm256_set1_ps(x_scale[r]), ws);
  };
  if (bf16) {
    rescale_rows_avx2(acc, m, n, scale_of, static_cast<const uint16_t*>(bias), n0, n1, static_cast<uint16_t*>(out));
  } else {
    rescale_rows_avx2(acc, m, n, scale_of, static_cast<const float*>(bias), n0, n1, static_cast<float*>(out));
  }
}

void rescale_int4_avx2(const float* y, int64_t m, int64_t n, const float* x_scale, const void* bias, bool bf16,
                       int64_t n0, int64_t n1, void* out) {
  auto scale_of = [=](int64_t r, int64_t) { return _mm256_set1_ps(x_scale[r]); };
  if (bf16) {
    rescale_rows_avx2(y, m, n, scale_of, static_cast<const uint16_t*>(bias), n0, n1, static_cast<uint16_t*>(out));
  } else {
    rescale_rows_avx2(y, m, n, scale_of, static_cast<const float*>(bias), n0, n1, static_cast<float*>(out));
  }
}

void quantize_rows_avx2(const void* x, bool bf16, int64_t m, int64_t k, int8_t* q, float* scale) {
  if (bf16) {
    quantize_rows_avx2_as(static_cast<const uint16_t*>(x), m, k, q, scale);
  } else {
    quantize_rows_avx2_as(static_cast<const float*>(x), m, k, q, scale);
  }
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
