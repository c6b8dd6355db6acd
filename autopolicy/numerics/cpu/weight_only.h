// Weight-only products for GPTQ and AWQ layers on CPUs: float32 activations against uint8 grid
// values with a float scale and a uint8 zero point per output row and group of consecutive
// inputs, in Keras's layout (autopolicy/numerics/weight_only.py):
//   q:     bits 4: (ceil(N/2), K) uint8, byte row j holding output rows 2j (low nibble) and
//          2j + 1 (high nibble); bits 8: (N, K) uint8, one value a byte (2-, 3- and 8-bit);
//   scale: (N, G) float32; zero: (N, G) uint8; G = ceil(K / group), group in [1, K];
//   xsum:  (M, G) float32, each row of x summed over each group (computed once per call);
//   the groups are consecutive runs of `group` inputs (g_idx = k / group; for any other g_idx,
//   weight_only_any_groups);
//   out[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] * q[n, k] - zero[n, g] * xsum[m, g]).
// So the inner loops are only value -> float conversions and multiply-adds; the zero points
// cost one term per group. Rows are streamed front to back, each its K contiguous bytes.
//
// The instruction-set variants sit side by side in the paths' table (kernels.h: Path::weight_only;
// a call may name its path), and weight_only_kernel() is the current path's (dispatch.cc: the
// CPU's features, AUTOPOLICY_CPU_PATH, set_path); the portable variant is the reference. No
// state across calls.
#pragma once

#include <cstdint>

namespace autopolicy_cpu {

struct WeightOnlyArgs {
  const float* x;  // (m, k)
  int64_t m, k;
  const uint8_t* q;
  int64_t n;
  int64_t bits;  // 4 (packed) or 8 (one value a byte)
  int64_t group;
  const float* scale;
  const uint8_t* zero;
  const float* xsum;
  float* out;  // (m, n)
};

// Computes out[:, n0:n1]; n0 is even when bits == 4 (a byte row is never split).
using WeightOnlyFn = void (*)(const WeightOnlyArgs& a, int64_t n0, int64_t n1);

void weight_only_portable(const WeightOnlyArgs& a, int64_t n0, int64_t n1);
// Any assignment of inputs to groups (GPTQ's act-order: group[k] need not be k / group): each
// weight dequantized with its own group's scale and zero point, as the XLA path does; plain C++
// on every path (act-order models are rare, and this still reads the stored bytes only once).
void weight_only_any_groups(const WeightOnlyArgs& a, const int32_t* group_of, int64_t n0, int64_t n1);
void weight_only_avx2(const WeightOnlyArgs& a, int64_t n0, int64_t n1);
// The same on 16 lanes (AVX-512 F/BW/VL), for the avx512_vnni path's CPUs.
void weight_only_avx512(const WeightOnlyArgs& a, int64_t n0, int64_t n1);

// The rows a SIMD pass computes: output rows [row, row + count) of R (rows past `count` repeat
// the last one, unstored), each with its bytes (packed: its pair's byte row) and its scales.
template <int R>
struct PassRows {
  const uint8_t* src[R];
  const float* scale[R];
  int64_t rows[R];

  PassRows(const WeightOnlyArgs& a, int64_t row, int64_t count) {
    const int64_t groups = (a.k + a.group - 1) / a.group;
    for (int j = 0; j < R; ++j) {
      rows[j] = row + (j < count - 1 ? j : count - 1);
      const int64_t pair = j / 2 < (count - 1) / 2 ? j / 2 : (count - 1) / 2;
      src[j] = a.bits == 4 ? a.q + (row / 2 + pair) * a.k : a.q + rows[j] * a.k;
      scale[j] = a.scale + rows[j] * groups;
    }
  }
};

// The kernel of the path in use (current_path().weight_only, kernels.h's dispatch table).
WeightOnlyFn weight_only_kernel();

}  // namespace autopolicy_cpu
