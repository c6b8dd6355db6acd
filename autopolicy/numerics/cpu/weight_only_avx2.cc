// The AVX2 + FMA weight-only product (weight_only.h). Pairs of output rows (the two halves of a
// packed byte row, or two byte rows), four rows a pass at one row of x: eight values are zero-extended to 32-bit lanes
// (vpmovzxbd; 4-bit: the low nibbles masked, the high ones shifted down), converted to float
// (vcvtdq2ps) and multiplied into per-group sums with vfmadd, each loaded chunk of x shared by
// both rows and each converted chunk of weights by up to four rows of x. A group's sums are
// scaled once at its end; the zero points' term is one dot product over the groups per row.
// One row of x leaves the FMA latency exposed: four output rows a pass give four independent
// sums (measured on Zen 3, one thread, groups of 32: 0.056 vs 0.068 ms at 576 x 1536 against
// two rows with two sets of sums; 1.09 vs 1.12 ms at 4096 x 4096; with one set of two rows,
// 1.31 ms per channel where two sets took 0.77). From two rows of x, one pair and one set: more
// sets spill registers (2x slower).
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

// Rows ahead of a pass that it prefetches: one sequential stream a thread leaves the hardware
// prefetchers too little to hide the memory's latency (measured on a 2-core Xeon with its AVX2
// path forced, 576 x 49152 8-bit per channel: see weight_only_avx512.cc).
constexpr int64_t kAhead = 32;

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

// Output rows [row, row + count) (count <= 2 * P: P pairs of rows) for rows [m0, m0 + M) of x,
// with S independent sets of sums per group. Rows past `count` repeat the last one, unstored.
template <int M, int S, int P, bool kPacked>
void row_block(const WeightOnlyArgs& a, int64_t m0, int64_t row, int64_t count) {
  constexpr int R = 2 * P;
  const int64_t k = a.k, groups = (k + a.group - 1) / a.group;
  const PassRows<R> pass(a, row, count);
  const uint8_t* const* src = pass.src;
  const float* const* scale = pass.scale;
  const int64_t* rows = pass.rows;
  const float* x = a.x + m0 * k;
  const __m256i low = _mm256_set1_epi32(0x0F);
  __m256 acc[M][R];
  float rest[M][R];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < R; ++j) {
      acc[r][j] = _mm256_setzero_ps();
      rest[r][j] = 0.0f;
    }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * a.group, k1 = std::min(k, k0 + a.group);
    __m256 t[S][M][R];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < M; ++r)
        for (int j = 0; j < R; ++j) t[s][r][j] = _mm256_setzero_ps();
    auto step = [&](__m256 (&sums)[M][R], int64_t i) {
      __m256 w[R];
      for (int j = 0; j < R; j += 2) {
        if (kPacked) {
          const __m256i v = widen8(src[j] + i);
          w[j] = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
          w[j + 1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        } else {
          w[j] = _mm256_cvtepi32_ps(widen8(src[j] + i));
          w[j + 1] = _mm256_cvtepi32_ps(widen8(src[j + 1] + i));
        }
      }
      for (int r = 0; r < M; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * k + i);
        for (int j = 0; j < R; ++j) sums[r][j] = _mm256_fmadd_ps(xv, w[j], sums[r][j]);
      }
    };
    int64_t i = k0;
    for (; i + 8 * S <= k1; i += 8 * S) {
      if (((i - k0) & 63) < 8 * S)  // once a cache line: the rows a few passes on (see kAhead)
        for (int j = 0; j < R; j += kPacked ? 2 : 1)
          _mm_prefetch(reinterpret_cast<const char*>(src[j] + i + kAhead * k), _MM_HINT_T0);
      for (int s = 0; s < S; ++s) step(t[s], i + 8 * s);
    }
    for (; i + 8 <= k1; i += 8) step(t[0], i);
    if (i < k1) {  // a group not a multiple of 8 long
      float tail[M][R] = {};
      for (; i < k1; ++i)
        for (int j = 0; j < R; ++j) {
          const float v = static_cast<float>(kPacked ? (j % 2 == 0 ? src[j][i] & 0x0F : src[j][i] >> 4) : src[j][i]);
          for (int r = 0; r < M; ++r) tail[r][j] += x[r * k + i] * v;
        }
      for (int r = 0; r < M; ++r)
        for (int j = 0; j < R; ++j) rest[r][j] += scale[j][g] * tail[r][j];
    }
    for (int j = 0; j < R; ++j) {
      const __m256 b = _mm256_set1_ps(scale[j][g]);
      for (int r = 0; r < M; ++r) {
        __m256 u = t[0][r][j];
        for (int s = 1; s < S; ++s) u = _mm256_add_ps(u, t[s][r][j]);
        acc[r][j] = _mm256_fmadd_ps(u, b, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < M; ++r) {
    const float* xsum = a.xsum + (m0 + r) * groups;
    float* out = a.out + (m0 + r) * a.n + row;
    for (int j = 0; j < R && j < count; ++j)
      out[j] = hsum(acc[r][j]) + rest[r][j] - zero_term(scale[j], a.zero + rows[j] * groups, xsum, groups);
  }
}

template <bool kPacked>
void run(const WeightOnlyArgs& a, int64_t n0, int64_t n1) {
  if (a.m == 1) {  // four output rows a pass: four independent sums, x loaded once for them
    for (int64_t row = n0; row < n1; row += 4) row_block<1, 1, 2, kPacked>(a, 0, row, std::min<int64_t>(4, n1 - row));
    return;
  }
  for (int64_t row = n0; row < n1; row += 2) {
    const int64_t count = std::min<int64_t>(2, n1 - row);
    // Up to four rows of x a pass; further passes find the pair's weights in L1.
    for (int64_t m0 = 0; m0 < a.m; m0 += 4) {
      switch (std::min<int64_t>(4, a.m - m0)) {
        case 1: row_block<1, 2, 1, kPacked>(a, m0, row, count); break;
        case 2: row_block<2, 1, 1, kPacked>(a, m0, row, count); break;
        case 3: row_block<3, 1, 1, kPacked>(a, m0, row, count); break;
        default: row_block<4, 1, 1, kPacked>(a, m0, row, count); break;
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
