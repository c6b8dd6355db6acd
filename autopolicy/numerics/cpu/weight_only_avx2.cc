// The AVX2 + FMA weight-only product (weight_only.h). Two output rows at a time (the two halves
// of a packed byte row, or two byte rows): eight values are zero-extended to 32-bit lanes
// (vpmovzxbd; 4-bit: the low nibbles masked, the high ones shifted down), converted to float
// (vcvtdq2ps) and multiplied into per-group sums with vfmadd, each loaded chunk of x shared by
// both rows and each converted chunk of weights by up to four rows of x. A group's sums are
// scaled once at its end; the zero points' term is one dot product over the groups per row.
// One row of x leaves the FMA latency exposed, so its sums are split over two independent sets
// (measured on Zen 3, 4096 x 4096, one thread: two sets 0.77 ms at per-channel groups, one set
// 1.31 ms, four 1.38 ms; at two rows of x and more, one set: two spill registers, 2x slower).
//
// Everything before the target pragma is compiled for the baseline ISA.
#include <algorithm>
#include <cstdint>

#include "weight_only.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

namespace autopolicy_cpu {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight bytes zero-extended to eight int32 lanes.
inline __m256i widen8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// sum_g scale[g] * zero[g] * xsum[g] over one row's groups.
inline float zero_term(const float* scale, const uint8_t* zero, const float* xsum, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 sz = _mm256_mul_ps(_mm256_loadu_ps(scale + g), _mm256_cvtepi32_ps(widen8(zero + g)));
    acc = _mm256_fmadd_ps(sz, _mm256_loadu_ps(xsum + g), acc);
  }
  float total = hsum(acc);
  for (; g < groups; ++g) total += scale[g] * static_cast<float>(zero[g]) * xsum[g];
  return total;
}

// Output rows `row` and `row + 1` (the latter only when `second`) for rows [m0, m0 + M) of x,
// with S independent sets of sums per group.
template <int M, int S, bool kPacked>
void row_pair(const WeightOnlyArgs& a, int64_t m0, int64_t row, bool second) {
  const int64_t k = a.k, groups = (k + a.group - 1) / a.group;
  const int64_t row1 = second ? row + 1 : row;  // a missing second row repeats the first, unstored
  const uint8_t* p0 = kPacked ? a.q + (row / 2) * k : a.q + row * k;
  const uint8_t* p1 = kPacked ? p0 : a.q + row1 * k;
  const float* scale0 = a.scale + row * groups;
  const float* scale1 = a.scale + row1 * groups;
  const float* x = a.x + m0 * k;
  const __m256i low = _mm256_set1_epi32(0x0F);
  __m256 acc[M][2];
  float rest[M][2];
  for (int r = 0; r < M; ++r) {
    acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    rest[r][0] = rest[r][1] = 0.0f;
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * a.group, k1 = std::min(k, k0 + a.group);
    __m256 t[S][M][2];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < M; ++r) t[s][r][0] = t[s][r][1] = _mm256_setzero_ps();
    auto step = [&](__m256 (&sums)[M][2], int64_t i) {
      __m256 w0, w1;
      if (kPacked) {
        const __m256i v = widen8(p0 + i);
        w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
        w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
      } else {
        w0 = _mm256_cvtepi32_ps(widen8(p0 + i));
        w1 = _mm256_cvtepi32_ps(widen8(p1 + i));
      }
      for (int r = 0; r < M; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * k + i);
        sums[r][0] = _mm256_fmadd_ps(xv, w0, sums[r][0]);
        sums[r][1] = _mm256_fmadd_ps(xv, w1, sums[r][1]);
      }
    };
    int64_t i = k0;
    for (; i + 8 * S <= k1; i += 8 * S)
      for (int s = 0; s < S; ++s) step(t[s], i + 8 * s);
    for (; i + 8 <= k1; i += 8) step(t[0], i);
    if (i < k1) {  // a group not a multiple of 8 long
      float tail[M][2] = {};
      for (; i < k1; ++i) {
        const float v0 = static_cast<float>(kPacked ? p0[i] & 0x0F : p0[i]);
        const float v1 = static_cast<float>(kPacked ? p0[i] >> 4 : p1[i]);
        for (int r = 0; r < M; ++r) {
          tail[r][0] += x[r * k + i] * v0;
          tail[r][1] += x[r * k + i] * v1;
        }
      }
      for (int r = 0; r < M; ++r) {
        rest[r][0] += scale0[g] * tail[r][0];
        rest[r][1] += scale1[g] * tail[r][1];
      }
    }
    const __m256 b0 = _mm256_set1_ps(scale0[g]), b1 = _mm256_set1_ps(scale1[g]);
    for (int r = 0; r < M; ++r) {
      __m256 u0 = t[0][r][0], u1 = t[0][r][1];
      for (int s = 1; s < S; ++s) {
        u0 = _mm256_add_ps(u0, t[s][r][0]);
        u1 = _mm256_add_ps(u1, t[s][r][1]);
      }
      acc[r][0] = _mm256_fmadd_ps(u0, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(u1, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < M; ++r) {
    const float* xsum = a.xsum + (m0 + r) * groups;
    float* out = a.out + (m0 + r) * a.n + row;
    out[0] = hsum(acc[r][0]) + rest[r][0] - zero_term(scale0, a.zero + row * groups, xsum, groups);
    if (second) out[1] = hsum(acc[r][1]) + rest[r][1] - zero_term(scale1, a.zero + row1 * groups, xsum, groups);
  }
}

template <bool kPacked>
void run(const WeightOnlyArgs& a, int64_t n0, int64_t n1) {
  for (int64_t row = n0; row < n1; row += 2) {
    const bool second = row + 1 < n1;
    // Up to four rows of x a pass; further passes find the pair's weights in L1.
    for (int64_t m0 = 0; m0 < a.m; m0 += 4) {
      switch (std::min<int64_t>(4, a.m - m0)) {
        case 1: row_pair<1, 2, kPacked>(a, m0, row, second); break;
        case 2: row_pair<2, 1, kPacked>(a, m0, row, second); break;
        case 3: row_pair<3, 1, kPacked>(a, m0, row, second); break;
        default: row_pair<4, 1, kPacked>(a, m0, row, second); break;
      }
    }
  }
}

}  // namespace

void weight_only_avx2(const WeightOnlyArgs& a, int64_t n0, int64_t n1) {
  if (a.bits == 4) {
    run<true>(a, n0, n1);
  } else {
    run<false>(a, n0, n1);
  }
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
