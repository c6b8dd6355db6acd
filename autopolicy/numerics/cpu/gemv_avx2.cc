// AVX2 variants. Each pair of K rows is sign-extended to 16 bits and interleaved, so one vpmaddwd
// multiplies 16 weights by a broadcast (x[k], x[k+1]) pair and adds the two products into 8
// int32 lanes: exact for every int8 value (no saturation, unlike vpmaddubsw), and the weights
// are read once, in their stored layout. Columns are processed in chunks of 16 (two 8-lane
// accumulators whose lanes come out in the order [0-3, 8-11] and [4-7, 12-15], put back in order
// on store); several rows of x share each loaded pair of weight rows.
//
// Everything before the target pragma is compiled for the baseline ISA, so no AVX2 code leaks
// into inline functions shared with the portable path.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

namespace autopolicy_cpu {
namespace {

inline __m256i pair_of(const int8_t* x, int64_t i, int64_t k) {
  const int32_t a = x[i];
  const int32_t b = i + 1 < k ? x[i + 1] : 0;
  return _mm256_set1_epi32((a & 0xFFFF) | (b << 16));
}

inline __m256i widen(const void* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p))); }

// Adds the two interleaved accumulators of 16 columns into out[0..16).
inline void add_store(int32_t* out, __m256i lo, __m256i hi, bool accumulate) {
  __m256i first = _mm256_permute2x128_si256(lo, hi, 0x20);
  __m256i second = _mm256_permute2x128_si256(lo, hi, 0x31);
  if (accumulate) {
    first = _mm256_add_epi32(first, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out)));
    second = _mm256_add_epi32(second, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + 8)));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), first);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8), second);
}

// Puts the accumulators of columns [n0, n1) (chunks of 16 kept as [0-3, 8-11], [4-7, 12-15]
// while summing) back in column order.
inline void unpermute(int32_t* row, int64_t n0, int64_t n1) {
  for (int64_t c = n0; c < n1; c += 16) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c + 8));
    add_store(row + c, lo, hi, false);
  }
}

// R rows of x times columns [n0, n1) (a multiple of 16 wide), streaming the weights row by row
// (four rows a pass, each read front to back: what the prefetchers and the TLB like best) into
// accumulators kept in memory (L1/L2-resident: 4 bytes per column and row of x).
template <int R>
void int8_stream(const int8_t* x, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1, int32_t* acc) {
  for (int r = 0; r < R; ++r) std::memset(acc + r * n + n0, 0, (n1 - n0) * sizeof(int32_t));
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t i = 0; i < k; i += 4) {
    const bool has[4] = {true, i + 1 < k, i + 2 < k, i + 3 < k};
    const int8_t* rows[4];
    for (int j = 0; j < 4; ++j) rows[j] = has[j] ? w + (i + j) * n : w;
    __m256i xp0[R], xp1[R];
    for (int r = 0; r < R; ++r) {
      xp0[r] = pair_of(x + r * k, i, k);
      xp1[r] = has[2] ? pair_of(x + r * k, i + 2, k) : zero;
    }
    for (int64_t c = n0; c < n1; c += 16) {
      const __m256i a = widen(rows[0] + c);
      const __m256i b = has[1] ? widen(rows[1] + c) : zero;
      const __m256i e = has[2] ? widen(rows[2] + c) : zero;
      const __m256i f = has[3] ? widen(rows[3] + c) : zero;
      const __m256i lo0 = _mm256_unpacklo_epi16(a, b), hi0 = _mm256_unpackhi_epi16(a, b);
      const __m256i lo1 = _mm256_unpacklo_epi16(e, f), hi1 = _mm256_unpackhi_epi16(e, f);
      for (int r = 0; r < R; ++r) {
        __m256i* p = reinterpret_cast<__m256i*>(acc + r * n + c);
        __m256i v0 = _mm256_loadu_si256(p), v1 = _mm256_loadu_si256(p + 1);
        v0 = _mm256_add_epi32(v0, _mm256_add_epi32(_mm256_madd_epi16(lo0, xp0[r]), _mm256_madd_epi16(lo1, xp1[r])));
        v1 = _mm256_add_epi32(v1, _mm256_add_epi32(_mm256_madd_epi16(hi0, xp0[r]), _mm256_madd_epi16(hi1, xp1[r])));
        _mm256_storeu_si256(p, v0);
        _mm256_storeu_si256(p + 1, v1);
      }
    }
  }
  for (int r = 0; r < R; ++r) unpermute(acc + r * n, n0, n1);
}

template <int R>
void int8_rows(const int8_t* x, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1, int32_t* acc) {
  const int64_t simd_end = n0 + (n1 - n0) / 16 * 16;
  if (simd_end > n0) int8_stream<R>(x, k, w, n, n0, simd_end, acc);
  if (simd_end < n1) {  // the last columns, fewer than 16
    for (int r = 0; r < R; ++r) int8_portable(x + r * k, 1, k, w, n, simd_end, n1, acc + r * n);
  }
}

inline __m256i low_nibbles(__m256i v) { return _mm256_srai_epi16(_mm256_slli_epi16(v, 12), 12); }
inline __m256i high_nibbles(__m256i v) { return _mm256_srai_epi16(v, 4); }

// R rows of x times columns [n0, n1) (a multiple of 16 wide) of a packed int4 kernel, one byte
// row a step: byte row j holds rows (2j, 2j + 1) in its (low, high) nibbles, exactly the pair
// one vpmaddwd multiplies by a broadcast (x[2j], x[2j + 1]). Each block is summed in int32 in a
// scratch row, and added into the float output times its scales when the block ends.
template <int R>
void int4_stream(const int8_t* x, int64_t k, const uint8_t* w, int64_t n, int64_t block, const float* scale,
                 int64_t n0, int64_t n1, float* out, int32_t* scratch) {
  const int64_t pairs = (k + 1) / 2, width = n1 - n0;
  int32_t* sums = scratch;  // (R, width)
  std::memset(sums, 0, R * width * sizeof(int32_t));
  for (int r = 0; r < R; ++r) std::memset(out + r * n + n0, 0, width * sizeof(float));
  auto flush = [&](int64_t g) {
    const float* s = scale + g * n;
    for (int r = 0; r < R; ++r) {
      float* y = out + r * n;
      int32_t* row = sums + r * width;
      for (int64_t c = n0; c < n1; c += 16) {
        int32_t* p = row + (c - n0);
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8));
        const __m256 first = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x20));
        const __m256 second = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x31));
        _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), _mm256_mul_ps(first, _mm256_loadu_ps(s + c))));
        _mm256_storeu_ps(y + c + 8,
                         _mm256_add_ps(_mm256_loadu_ps(y + c + 8), _mm256_mul_ps(second, _mm256_loadu_ps(s + c + 8))));
      }
      std::memset(row, 0, width * sizeof(int32_t));
    }
  };
  int64_t group = 0;
  for (int64_t j = 0; j < pairs; ++j) {
    const int64_t g = (2 * j) / block;  // the pair's block (blocks are even: no pair straddles two)
    if (g != group) { flush(group); group = g; }
    __m256i xp[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = x + r * k;
      const int32_t x0 = xr[2 * j], x1 = 2 * j + 1 < k ? xr[2 * j + 1] : 0;  // odd K: the pad row is 0
      xp[r] = _mm256_set1_epi32((x0 & 0xFFFF) | (x1 << 16));
    }
    const uint8_t* row = w + j * n;
    for (int64_t c = n0; c < n1; c += 16) {
      const __m256i a = widen(row + c);
      const __m256i even = low_nibbles(a), odd = high_nibbles(a);
      const __m256i p0 = _mm256_unpacklo_epi16(even, odd), p1 = _mm256_unpackhi_epi16(even, odd);
      for (int r = 0; r < R; ++r) {
        __m256i* acc = reinterpret_cast<__m256i*>(sums + r * width + (c - n0));
        _mm256_storeu_si256(acc, _mm256_add_epi32(_mm256_loadu_si256(acc), _mm256_madd_epi16(p0, xp[r])));
        _mm256_storeu_si256(acc + 1, _mm256_add_epi32(_mm256_loadu_si256(acc + 1), _mm256_madd_epi16(p1, xp[r])));
      }
    }
  }
  flush(group);
}

}  // namespace

void int8_avx2(const int8_t* x, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1,
               int32_t* acc) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) int8_rows<4>(x + r * k, k, w, n, n0, n1, acc + r * n);
  for (; r + 2 <= m; r += 2) int8_rows<2>(x + r * k, k, w, n, n0, n1, acc + r * n);
  for (; r < m; ++r) int8_rows<1>(x + r * k, k, w, n, n0, n1, acc + r * n);
}

// Needs pairs of rows (2j, 2j + 1) never to straddle a block: an even block (or one block); the
// FFI binding checks it and runs the portable path otherwise.
void int4_avx2(const int8_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
               const float* scale, int64_t n0, int64_t n1, float* out) {
  const int64_t simd_end = n0 + (n1 - n0) / 16 * 16;
  if (simd_end > n0) {
    std::vector<int32_t> scratch(2 * (simd_end - n0));
    int64_t r = 0;
    for (; r + 2 <= m; r += 2)
      int4_stream<2>(x + r * k, k, w, n, block, scale, n0, simd_end, out + r * n, scratch.data());
    for (; r < m; ++r) int4_stream<1>(x + r * k, k, w, n, block, scale, n0, simd_end, out + r * n, scratch.data());
  }
  if (simd_end < n1) int4_portable(x, m, k, w, n, block, scale, simd_end, n1, out);
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
