// The float ends of the fused dense calls (ffi.cc): rows of float32 or bfloat16 activations
// quantized to int8 before the integer product, and the int32 (or per-block float) sums rescaled
// (plus an optional bias) into float32 or bfloat16 after it. Each does the operations of the
// package's XLA path in the same order and the same float32 rounding, so the outputs are equal
// bit for bit (tests/test_cpu_kernels.py). Plain C++: a few thousand elements a call, far from
// the cost of the weights' traffic.
#include <algorithm>
#include <cmath>

#include "kernels.h"

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

}  // namespace

void quantize_rows(const void* x, bool bf16, int64_t m, int64_t k, int8_t* q, float* scale) {
  if (bf16) {
    quantize_rows_as(static_cast<const uint16_t*>(x), m, k, q, scale);
  } else {
    quantize_rows_as(static_cast<const float*>(x), m, k, q, scale);
  }
}

void rescale_int8(const int32_t* acc, int64_t m, int64_t n, const float* x_scale, const float* w_scale,
                  const void* bias, bool bf16, int64_t n0, int64_t n1, void* out) {
  if (bf16) {
    rescale_int8_as(acc, m, n, x_scale, w_scale, static_cast<const uint16_t*>(bias), n0, n1,
                    static_cast<uint16_t*>(out));
  } else {
    rescale_int8_as(acc, m, n, x_scale, w_scale, static_cast<const float*>(bias), n0, n1, static_cast<float*>(out));
  }
}

void rescale_int4(const float* y, int64_t m, int64_t n, const float* x_scale, const void* bias, bool bf16,
                  int64_t n0, int64_t n1, void* out) {
  if (bf16) {
    rescale_int4_as(y, m, n, x_scale, static_cast<const uint16_t*>(bias), n0, n1, static_cast<uint16_t*>(out));
  } else {
    rescale_int4_as(y, m, n, x_scale, static_cast<const float*>(bias), n0, n1, static_cast<float*>(out));
  }
}

}  // namespace autopolicy_cpu
