// The portable reference: plain loops, the same sums as every SIMD path.
#include <algorithm>
#include <vector>

#include "kernels.h"

namespace autopolicy_cpu {

void int8_portable(const int8_t* x, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1,
                   int32_t* acc) {
  for (int64_t r = 0; r < m; ++r) {
    int32_t* out = acc + r * n;
    for (int64_t c = n0; c < n1; ++c) out[c] = 0;
    for (int64_t i = 0; i < k; ++i) {
      const int32_t xv = x[r * k + i];
      const int8_t* row = w + i * n;
      for (int64_t c = n0; c < n1; ++c) out[c] += xv * static_cast<int32_t>(row[c]);
    }
  }
}

static inline int32_t low_nibble(uint8_t b) { return static_cast<int32_t>(static_cast<int8_t>(b << 4)) >> 4; }
static inline int32_t high_nibble(uint8_t b) { return static_cast<int32_t>(static_cast<int8_t>(b)) >> 4; }

void int4_portable(const int8_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                   const float* scale, int64_t n0, int64_t n1, float* out) {
  std::vector<int32_t> sums(n1 - n0);
  for (int64_t r = 0; r < m; ++r) {
    float* y = out + r * n;
    for (int64_t g = 0; g * block < k; ++g) {
      std::fill(sums.begin(), sums.end(), 0);
      for (int64_t i = g * block; i < std::min(k, (g + 1) * block); ++i) {
        const int32_t xv = x[r * k + i];
        const bool high = i % 2 == 1;  // row i is in byte row i / 2: even rows low, odd rows high
        const uint8_t* row = w + (i / 2) * n;
        for (int64_t c = n0; c < n1; ++c) sums[c - n0] += xv * (high ? high_nibble(row[c]) : low_nibble(row[c]));
      }
      for (int64_t c = n0; c < n1; ++c) {
        const float term = static_cast<float>(sums[c - n0]) * scale[g * n + c];
        y[c] = g == 0 ? term : y[c] + term;
      }
    }
  }
}

}  // namespace autopolicy_cpu
