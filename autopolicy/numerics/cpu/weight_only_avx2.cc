// The AVX2 + FMA weight-only product (weight_only.h). Eight values at a time are zero-extended to
// 32-bit lanes (vpmovzxbd; 4-bit: the low nibbles masked, the high ones shifted down), converted
// to float (vcvtdq2ps) and multiplied into per-group sums with vfmadd. A group's sums are scaled
// once at its end; the zero points' term is one dot product over the groups per row.
// - One row of x (decoding): the byte rows one after another, each a single sequential stream
//   (stream_rows; see kStreamAhead for the figures).
// - More rows of x: pairs of output rows (the two halves of a packed byte row, or two byte rows),
//   up to four rows of x a pass, each loaded chunk of x shared by both rows and each converted
//   chunk of weights by the rows of x; from two rows of x, one pair and one set of sums (more
//   sets spill registers: 2x slower).
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

// Output rows [row, row + count) (count <= 2: a pair of rows) for rows [m0, m0 + M) of x,
// with S independent sets of sums per group. Rows past `count` repeat the last one, unstored.
template <int M, int S, bool kPacked>
void row_block(const WeightOnlyArgs& a, int64_t m0, int64_t row, int64_t count) {
  constexpr int R = 2;
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

// One row of x: the stored rows one after another, front to back, so a thread reads one
// sequential stream (a byte row: one output row, or the two of a packed pair), prefetched
// kStreamAhead bytes on; four sets of sums per output row hide the FMA latency. This replaced
// four output rows a pass (four streams k bytes apart, x loaded once for them), which read the
// weights at half the memory's rate: on a 2-core EPYC (Zen 3, AVX2), weights streamed from
// memory, both threads, 576 x 49152 at 8 bits per channel: 3.29 -> 1.77 ms (16.0 GB/s; float32
// XLA 5.6 ms), 576 x 1536: 1.65x, 1536 x 576: 1.42x, 576 x 576 and 576 x 192: 1.0-1.25x
// (benchmarks/ab_cpu_kernels.py --weight-only --layers). One thread, 576 x 49152 from memory:
// four streams 4.0-5.0 GB/s, one stream 8.0 GB/s, prefetched 4 KB on 10.7-12.8 GB/s.
constexpr int64_t kStreamAhead = 4096;

template <bool kPacked>
void stream_rows(const WeightOnlyArgs& a, int64_t n0, int64_t n1) {
  constexpr int R = kPacked ? 2 : 1;  // output rows per byte row
  const int64_t k = a.k, groups = (k + a.group - 1) / a.group;
  const float* x = a.x;
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int64_t row = n0; row < n1; row += R) {
    const int64_t count = std::min<int64_t>(R, n1 - row);
    const uint8_t* src = a.q + (kPacked ? row / 2 : row) * k;
    const float* scale[R];
    for (int j = 0; j < R; ++j) scale[j] = a.scale + (row + std::min<int64_t>(j, count - 1)) * groups;
    __m256 acc[R];
    float rest[R];
    for (int j = 0; j < R; ++j) {
      acc[j] = _mm256_setzero_ps();
      rest[j] = 0.0f;
    }
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * a.group, k1 = std::min(k, k0 + a.group);
      __m256 t[4][R];
      for (int s = 0; s < 4; ++s)
        for (int j = 0; j < R; ++j) t[s][j] = _mm256_setzero_ps();
      auto step = [&](__m256 (&sums)[R], int64_t i) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        const __m256i v = widen8(src + i);
        if (kPacked) {
          sums[0] = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(_mm256_and_si256(v, low)), sums[0]);
          sums[R - 1] = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), sums[R - 1]);
        } else {
          sums[0] = _mm256_fmadd_ps(xv, _mm256_cvtepi32_ps(v), sums[0]);
        }
      };
      int64_t i = k0;
      for (; i + 32 <= k1; i += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(src + i + kStreamAhead), _MM_HINT_T0);
        for (int s = 0; s < 4; ++s) step(t[s], i + 8 * s);
      }
      for (; i + 8 <= k1; i += 8) step(t[0], i);  // t[0] only: a run-time index would keep t in memory
      if (i < k1) {  // a group not a multiple of 8 long
        float tail[R] = {};
        for (; i < k1; ++i)
          for (int j = 0; j < R; ++j)
            tail[j] += x[i] * static_cast<float>(kPacked ? (j == 0 ? src[i] & 0x0F : src[i] >> 4) : src[i]);
        for (int j = 0; j < R; ++j) rest[j] += scale[j][g] * tail[j];
      }
      for (int j = 0; j < R; ++j) {
        const __m256 u = _mm256_add_ps(_mm256_add_ps(t[0][j], t[1][j]), _mm256_add_ps(t[2][j], t[3][j]));
        acc[j] = _mm256_fmadd_ps(u, _mm256_set1_ps(scale[j][g]), acc[j]);
      }
    }
    for (int j = 0; j < count; ++j)
      a.out[row + j] = hsum(acc[j]) + rest[j] - zero_term(scale[j], a.zero + (row + j) * groups, a.xsum, groups);
  }
}

template <bool kPacked>
void run(const WeightOnlyArgs& a, int64_t n0, int64_t n1) {
  if (a.m == 1) {
    stream_rows<kPacked>(a, n0, n1);
    return;
  }
  for (int64_t row = n0; row < n1; row += 2) {
    const int64_t count = std::min<int64_t>(2, n1 - row);
    // Up to four rows of x a pass; further passes find the pair's weights in L1.
    for (int64_t m0 = 0; m0 < a.m; m0 += 4) {
      switch (std::min<int64_t>(4, a.m - m0)) {
        case 1: row_block<1, 2, kPacked>(a, m0, row, count); break;
        case 2: row_block<2, 1, kPacked>(a, m0, row, count); break;
        case 3: row_block<3, 1, kPacked>(a, m0, row, count); break;
        default: row_block<4, 1, kPacked>(a, m0, row, count); break;
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
