// The portable reference of the weight-only product (weight_only.h): plain C++, groups summed
// in order, each group's dot product in input order; and the product for any g_idx.
#include <algorithm>
#include <cstdint>

#include "weight_only.h"

namespace autopolicy_cpu {
namespace {

inline float value_at(const WeightOnlyArgs& a, int64_t row, int64_t col) {
  if (a.bits == 4) {
    const uint8_t byte = a.q[(row / 2) * a.k + col];
    return static_cast<float>(row % 2 == 0 ? byte & 0x0F : byte >> 4);
  }
  return static_cast<float>(a.q[row * a.k + col]);
}

}  // namespace

void weight_only_portable(const WeightOnlyArgs& a, int64_t n0, int64_t n1) {
  const int64_t groups = (a.k + a.group - 1) / a.group;
  for (int64_t m = 0; m < a.m; ++m) {
    const float* x = a.x + m * a.k;
    for (int64_t row = n0; row < n1; ++row) {
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t k0 = g * a.group, k1 = std::min(a.k, k0 + a.group);
        float dot = 0.0f;
        for (int64_t i = k0; i < k1; ++i) dot += x[i] * value_at(a, row, i);
        const float zero = static_cast<float>(a.zero[row * groups + g]);
        total += a.scale[row * groups + g] * (dot - zero * a.xsum[m * groups + g]);
      }
      a.out[m * a.n + row] = total;
    }
  }
}

void weight_only_any_groups(const WeightOnlyArgs& a, const int32_t* group_of, int64_t n0, int64_t n1) {
  const int64_t groups = (a.k + a.group - 1) / a.group;
  for (int64_t m = 0; m < a.m; ++m) {
    const float* x = a.x + m * a.k;
    for (int64_t row = n0; row < n1; ++row) {
      const float* scale = a.scale + row * groups;
      const uint8_t* zero = a.zero + row * groups;
      float total = 0.0f;
      for (int64_t i = 0; i < a.k; ++i) {
        const int32_t g = group_of[i];
        total += x[i] * (scale[g] * (value_at(a, row, i) - static_cast<float>(zero[g])));
      }
      a.out[m * a.n + row] = total;
    }
  }
}

}  // namespace autopolicy_cpu
