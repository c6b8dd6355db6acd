// The AVX-512 weight-only product (weight_only.h), for the CPUs of the avx512_vnni path: the AVX2
// kernel's plan (weight_only_avx2.cc) on 16 lanes. Sixteen values a step are zero-extended to
// 32-bit lanes (vpmovzxbd; 4-bit: the low nibbles masked, the high ones shifted down), converted
// to float and multiplied into per-group sums with vfmadd, each loaded chunk of x shared by the
// output rows of a pass and each converted chunk of weights by the rows of x. The end of a group
// that is not a multiple of 16 long is one masked step (the masked lanes load nothing and add
// zero), so no scalar tail. A group's sums are scaled once at its end; the zero points' term is
// one dot product over the groups per row.
//
// Measured and left out (2026-11-26, 2-core Xeon with AVX512-VNNI): the inputs as 28-bit fixed
// point in four byte digits against the grid bytes with vpdpbusd (four products of 64 a step
// where this kernel widens, converts and multiplies 16 a step), combined in float at each
// group's end. Kernel alone (`benchmarks/ab_cpu_kernels.py --weight-only`), at batch 1 it was
// 1.04-1.20x this kernel per channel and 0.82-0.96x in groups of 32 or 128 (the per-group
// combine), 0.86x on the 576 x 49152 head at 8 bits; at batch 4, 0.57-0.78x everywhere.
//
// Everything before the target pragma is compiled for the baseline ISA.
#include <algorithm>
#include <cstdint>

#include "weight_only.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl")
#include <immintrin.h>

namespace autopolicy_cpu {
namespace {

constexpr int64_t kLanes = 16;
// Byte rows ahead of a pass that it prefetches.
constexpr int64_t kAhead = 32;

// Sixteen bytes (those the mask keeps) zero-extended to sixteen int32 lanes.
inline __m512i widen16(const uint8_t* p, __mmask16 keep) {
  return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(keep, p));
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

// sum_g scale[g] * zero[g] * xsum[g] over one row's groups.
inline float zero_term(const float* scale, const uint8_t* zero, const float* xsum, int64_t groups) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += kLanes) {
    const __mmask16 keep = first_lanes(groups - g);
    const __m512 sz = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, scale + g), _mm512_cvtepi32_ps(widen16(zero + g, keep)));
    acc = _mm512_fmadd_ps(sz, _mm512_maskz_loadu_ps(keep, xsum + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// Output rows [row, row + count) (count <= 2 * P: P pairs of rows) for rows [m0, m0 + M) of x.
// Rows past `count` repeat the last one, unstored.
template <int M, int P, bool kPacked>
void row_block(const WeightOnlyArgs& a, int64_t m0, int64_t row, int64_t count) {
  constexpr int R = 2 * P;
  const int64_t k = a.k, groups = (k + a.group - 1) / a.group;
  const PassRows<R> pass(a, row, count);
  const uint8_t* const* src = pass.src;
  const float* const* scale = pass.scale;
  const int64_t* rows = pass.rows;
  const float* x = a.x + m0 * k;
  const __m512i low = _mm512_set1_epi32(0x0F);
  __m512 acc[M][R];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < R; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * a.group, k1 = std::min(k, k0 + a.group);
    __m512 t[M][R];
    for (int r = 0; r < M; ++r)
      for (int j = 0; j < R; ++j) t[r][j] = _mm512_setzero_ps();
    auto step = [&](int64_t i, __mmask16 keep) __attribute__((always_inline)) {
      __m512 w[R];
      for (int j = 0; j < R; j += 2) {
        if (kPacked) {
          const __m512i v = widen16(src[j] + i, keep);
          w[j] = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
          w[j + 1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        } else {
          w[j] = _mm512_cvtepi32_ps(widen16(src[j] + i, keep));
          w[j + 1] = _mm512_cvtepi32_ps(widen16(src[j + 1] + i, keep));
        }
      }
      for (int r = 0; r < M; ++r) {
        const __m512 xv = _mm512_maskz_loadu_ps(keep, x + r * k + i);
        for (int j = 0; j < R; ++j) t[r][j] = _mm512_fmadd_ps(xv, w[j], t[r][j]);
      }
    };
    int64_t i = k0;
    for (; i + kLanes <= k1; i += kLanes) {
      // The rows a few passes on, fetched while this one runs (one sequential stream a thread
      // leaves the hardware prefetchers too little to hide the memory's latency).
      for (int j = 0; j < R; j += kPacked ? 2 : 1) _mm_prefetch(reinterpret_cast<const char*>(src[j] + i + kAhead * k), _MM_HINT_T0);
      step(i, static_cast<__mmask16>(0xFFFF));
    }
    if (i < k1) step(i, first_lanes(k1 - i));
    for (int j = 0; j < R; ++j) {
      const __m512 b = _mm512_set1_ps(scale[j][g]);
      for (int r = 0; r < M; ++r) acc[r][j] = _mm512_fmadd_ps(t[r][j], b, acc[r][j]);
    }
  }
  for (int r = 0; r < M; ++r) {
    const float* xsum = a.xsum + (m0 + r) * groups;
    float* out = a.out + (m0 + r) * a.n + row;
    for (int j = 0; j < R && j < count; ++j)
      out[j] = _mm512_reduce_add_ps(acc[r][j]) - zero_term(scale[j], a.zero + rows[j] * groups, xsum, groups);
  }
}

template <bool kPacked>
void run(const WeightOnlyArgs& a, int64_t n0, int64_t n1) {
  if (a.m == 1) {  // four output rows a pass: four independent sums, x loaded once for them
    for (int64_t row = n0; row < n1; row += 4) row_block<1, 2, kPacked>(a, 0, row, std::min<int64_t>(4, n1 - row));
    return;
  }
  for (int64_t row = n0; row < n1; row += 2) {
    const int64_t count = std::min<int64_t>(2, n1 - row);
    // Up to four rows of x a pass; further passes find the pair's weights in L1.
    for (int64_t m0 = 0; m0 < a.m; m0 += 4) {
      switch (std::min<int64_t>(4, a.m - m0)) {
        case 1: row_block<1, 1, kPacked>(a, m0, row, count); break;
        case 2: row_block<2, 1, kPacked>(a, m0, row, count); break;
        case 3: row_block<3, 1, kPacked>(a, m0, row, count); break;
        default: row_block<4, 1, kPacked>(a, m0, row, count); break;
      }
    }
  }
}

}  // namespace

void weight_only_avx512(const WeightOnlyArgs& a, int64_t n0, int64_t n1) {
  if (a.bits == 4) {
    run<true>(a, n0, n1);
  } else {
    run<false>(a, n0, n1);
  }
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
