// AVX512-VNNI streaming variants of the int8 and int4 products (kernels.h), for CPUs with
// vpdpbusd (Intel Cascade Lake and later, AMD Zen 4 and later): one instruction multiplies 64
// unsigned bytes by 64 signed bytes and adds each group of four products into a 32-bit lane,
// where the AVX2 path needs widening, vpmaddwd and vpaddd for 16 products.
//
// vpdpbusd wants quads: the four bytes of a lane must be four consecutive K rows of one output
// column. The stored weights are row-major (K rows of N columns: int8 one byte per weight; int4
// two K rows per byte row), so four rows' 64-byte pieces are interleaved with two rounds of
// unpacks (bytes, then 16-bit pairs) into four registers whose 128-bit lane L holds columns
// 16L + 4t .. 16L + 4t + 3 (register t). The sums stay in that order while they accumulate and
// are put back in column order (a 4 x 4 transpose of 128-bit lanes) once, at the end.
//
// Signs: the unsigned operand is the weights, offset into [0, 255] (int8: w xor 0x80 = w + 128;
// int4: the nibble xor 8 = v + 8, as the AVX2 path does), the signed one the activations, so
// every int8 activation, -128 included, is taken as it is. The offset adds 128 (or 8) times the
// sum of the activations over the rows summed, which is subtracted per row of x (and block) at
// the end: the int32 sums are exact, as on every other path (vpdpbusd wraps like int32
// arithmetic, so the result is exact whenever the true sum fits in int32). int4 blocks end in
// the portable path's float operations in its order (out = term, then out + term), so its
// outputs are bit-identical.
//
// Columns come in chunks of 64; the last columns of a range (fewer than 64) go to the AVX2
// kernels (every VNNI CPU has AVX2). int4 needs quads never to straddle a block: blocks a
// multiple of 4 long, or one block; the FFI binding sends any other block to the AVX2 kernel.
//
// Everything before the target pragma is compiled for the baseline ISA.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
#include <immintrin.h>

namespace autopolicy_cpu {
namespace {

constexpr int64_t kChunk = 64;  // columns a vector of bytes holds

// The rows of x as quads ([row][quad]).
void pack_quads(const int8_t* x, int rows, int64_t k, std::vector<int32_t>& quads) {
  const int64_t count = (k + 3) / 4;
  quads.resize(static_cast<size_t>(rows * count));
  for (int r = 0; r < rows; ++r)
    for (int64_t q = 0; q < count; ++q) quads[r * count + q] = quad_of(x + r * k, 4 * q, k);
}

int32_t sum_of(const int8_t* x, int64_t i0, int64_t i1) {
  int32_t total = 0;
  for (int64_t i = i0; i < i1; ++i) total += x[i];
  return total;
}

// Four rows' bytes (a, b, c, d: K rows 4i .. 4i + 3 of 64 columns) as quads: q[t], lane L, holds
// columns 16L + 4t .. 16L + 4t + 3, each lane the bytes (a, b, c, d) of one column.
inline void to_quads(__m512i a, __m512i b, __m512i c, __m512i d, __m512i (&q)[4]) {
  const __m512i ab_lo = _mm512_unpacklo_epi8(a, b), ab_hi = _mm512_unpackhi_epi8(a, b);
  const __m512i cd_lo = _mm512_unpacklo_epi8(c, d), cd_hi = _mm512_unpackhi_epi8(c, d);
  q[0] = _mm512_unpacklo_epi16(ab_lo, cd_lo);
  q[1] = _mm512_unpackhi_epi16(ab_lo, cd_lo);
  q[2] = _mm512_unpacklo_epi16(ab_hi, cd_hi);
  q[3] = _mm512_unpackhi_epi16(ab_hi, cd_hi);
}

// The sums of 64 columns in quad order (four vectors) back in column order.
inline void in_order_lanes(const __m512i (&s)[4], __m512i (&out)[4]) {
  const __m512i ab01 = _mm512_shuffle_i32x4(s[0], s[1], 0x44), cd01 = _mm512_shuffle_i32x4(s[2], s[3], 0x44);
  const __m512i ab23 = _mm512_shuffle_i32x4(s[0], s[1], 0xEE), cd23 = _mm512_shuffle_i32x4(s[2], s[3], 0xEE);
  out[0] = _mm512_shuffle_i32x4(ab01, cd01, 0x88);
  out[1] = _mm512_shuffle_i32x4(ab01, cd01, 0xDD);
  out[2] = _mm512_shuffle_i32x4(ab23, cd23, 0x88);
  out[3] = _mm512_shuffle_i32x4(ab23, cd23, 0xDD);
}

// Quads of K rows a pass: the sums of a pass stay in registers, and go to memory (L1/L2: 4 bytes
// per column and row of x) only between passes.
constexpr int kQuads = 4;
// The int8 stream over narrow whole rows at one or two rows of x (a decoder's projections, K
// slabs of them) takes kNarrowQuads quads (8 K rows) a pass and fetches the next pass in order.
// On a SmolLM2-135M decode step (benchmarks/smollm2_cpu_paths.py --rounds 4, int8 everywhere,
// a 2-core Zen 4 EPYC with AVX-512 VNNI) that ran at 2.75-2.78x float32 in three runs, against
// 2.52-2.68x with 16 rows a pass and the next pass fetched row by row (int4 with the in-order
// fetch alone: 3.66-3.81x against 3.59-3.68x). With 16 rows and the in-order fetch, or 4 rows,
// the layers were no faster than with 8 (benchmarks/ab_cpu_kernels.py --layers).
constexpr int kNarrowQuads = 2;

thread_local std::vector<int32_t> t_quads, t_sums;

// R rows of x times columns [n0, n1) (a multiple of 64 wide): 4 * Q K rows a pass (each weight
// row read front to back), the int32 sums kept in acc in quad order between passes; the last pass
// writes them in column order, less 128 * sum(x).
template <int R, int Q>
void int8_stream(const int8_t* x, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1, int32_t* acc) {
  const int64_t count = (k + 3) / 4;
  pack_quads(x, R, k, t_quads);
  const int32_t* xq = t_quads.data();
  __m512i corr[R];
  for (int r = 0; r < R; ++r) corr[r] = _mm512_set1_epi32(128 * sum_of(x + r * k, 0, k));
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < k; i += 4 * Q) {
    const bool first = i == 0, last = i + 4 * Q >= k;
    const int8_t* rows[4 * Q];
    for (int j = 0; j < 4 * Q; ++j) rows[j] = i + j < k ? w + (i + j) * n : w;  // past K: x is 0 there
    int32_t xw[Q][R];
    for (int u = 0; u < Q; ++u)
      for (int r = 0; r < R; ++r) xw[u][r] = i / 4 + u < count ? xq[r * count + i / 4 + u] : 0;
    // The next pass's rows, fetched while this one runs (as int4_stream does), at one or two rows
    // of x (decoding: the weights stream from memory once; with more rows the passes re-read
    // weights the caches hold, and the prefetches cost more than they bring) over narrow ranges:
    // over whole rows one contiguous stretch of 4 * Q * n bytes, line by line in order (4 * Q
    // lines per 64 columns of this pass), over part of each row one line of each row.
    const bool fetch = R <= 2 && n1 - n0 <= kNarrowColumns && i + 8 * Q <= k;
    const bool whole = whole_rows(n0, n1, n);
    const char* in_order = fetch && whole ? reinterpret_cast<const char*>(w + (i + 4 * Q) * n) : nullptr;
    const int8_t* ahead = fetch && !whole ? w + (i + 4 * Q) * n : nullptr;
    for (int64_t c = n0; c < n1; c += kChunk) {
      if (in_order != nullptr)
        for (int j = 0; j < 4 * Q; ++j) _mm_prefetch(in_order + 4 * Q * c + 64 * j, _MM_HINT_T0);
      if (ahead != nullptr)
        for (int j = 0; j < 4 * Q; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * n + c), _MM_HINT_T0);
      __m512i s[R][4];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < 4; ++t)
          s[r][t] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(acc + r * n + c + 16 * t);
      for (int u = 0; u < Q; ++u) {
        __m512i q[4];
        to_quads(_mm512_xor_si512(_mm512_loadu_si512(rows[4 * u] + c), flip),
                 _mm512_xor_si512(_mm512_loadu_si512(rows[4 * u + 1] + c), flip),
                 _mm512_xor_si512(_mm512_loadu_si512(rows[4 * u + 2] + c), flip),
                 _mm512_xor_si512(_mm512_loadu_si512(rows[4 * u + 3] + c), flip), q);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_set1_epi32(xw[u][r]);
          for (int t = 0; t < 4; ++t) s[r][t] = _mm512_dpbusd_epi32(s[r][t], q[t], xv);
        }
      }
      for (int r = 0; r < R; ++r) {
        int32_t* p = acc + r * n + c;
        if (last) {
          __m512i ordered[4];
          in_order_lanes(s[r], ordered);
          for (int t = 0; t < 4; ++t) _mm512_storeu_si512(p + 16 * t, _mm512_sub_epi32(ordered[t], corr[r]));
        } else {
          for (int t = 0; t < 4; ++t) _mm512_storeu_si512(p + 16 * t, s[r][t]);
        }
      }
    }
  }
}

// The int8 stream for R rows over [n0, n1): narrow whole rows at one or two rows of x take
// kNarrowQuads quads a pass, the rest kQuads.
template <int R>
void int8_rows(const int8_t* x, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1, int32_t* acc) {
  if (R <= 2 && n1 - n0 <= kNarrowColumns && whole_rows(n0, n1, n))
    int8_stream<R, kNarrowQuads>(x, k, w, n, n0, n1, acc);
  else
    int8_stream<R, kQuads>(x, k, w, n, n0, n1, acc);
}

// R rows of x times columns [n0, n1) (a multiple of 64 wide) of the packed int4 kernel, block by
// block, 2 * kQuads byte rows (4 * kQuads K rows) a pass; a block's int32 sums wait in a scratch
// between its passes, and its last pass ends them: in column order, less 8 * the block's sum of
// x, converted to float, times the scales, added into the output in block order.
template <int R>
void int4_stream(const int8_t* x, int64_t k, const uint8_t* w, int64_t n, int64_t block, const float* scale,
                 int64_t n0, int64_t n1, float* out) {
  const int64_t pairs = (k + 1) / 2, width = n1 - n0, count = (k + 3) / 4;
  const int64_t groups = (k + block - 1) / block;
  const int64_t block_pairs = groups == 1 ? pairs : block / 2;  // a multiple of 2, or one block
  pack_quads(x, R, k, t_quads);
  const int32_t* xq = t_quads.data();
  if (block_pairs > 2 * kQuads && t_sums.size() < static_cast<size_t>(R * width))
    t_sums.resize(static_cast<size_t>(R * width));
  int32_t* sums = t_sums.data();
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x88));
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t j0 = g * block_pairs, j1 = std::min(pairs, j0 + block_pairs);
    const float* sg = scale + g * n;
    __m512i corr[R];
    for (int r = 0; r < R; ++r) corr[r] = _mm512_set1_epi32(8 * sum_of(x + r * k, 2 * j0, std::min(k, 2 * j1)));
    for (int64_t jg = j0; jg < j1; jg += 2 * kQuads) {
      const bool first = jg == j0, last = jg + 2 * kQuads >= j1;
      const uint8_t* rows[2 * kQuads];
      for (int j = 0; j < 2 * kQuads; ++j) rows[j] = jg + j < j1 ? w + (jg + j) * n : w;  // x is 0 there
      // The next pass's rows (the next block's, after the last), fetched while this one runs:
      // a thread's share of a row can be too short for the hardware prefetchers to pick up.
      // Over whole rows that stretch is contiguous: fetched line by line in order (2 * kQuads
      // lines per 64 columns of this pass).
      const bool fetch = jg + 4 * kQuads <= pairs, whole = whole_rows(n0, n1, n);
      const char* in_order = fetch && whole ? reinterpret_cast<const char*>(w + (jg + 2 * kQuads) * n) : nullptr;
      const uint8_t* ahead = fetch && !whole ? w + (jg + 2 * kQuads) * n : nullptr;
      // Byte rows j, j + 1 are K rows 2j .. 2j + 3: quad j / 2 (j0 is even: blocks are a multiple of 4).
      int32_t xw[kQuads][R];
      for (int u = 0; u < kQuads; ++u)
        for (int r = 0; r < R; ++r) xw[u][r] = jg + 2 * u < j1 ? xq[r * count + jg / 2 + u] : 0;
      for (int64_t c = n0; c < n1; c += kChunk) {
        __m512i s[R][4];
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < 4; ++t)
            s[r][t] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(sums + r * width + (c - n0) + 16 * t);
        if (in_order != nullptr)
          for (int j = 0; j < 2 * kQuads; ++j) _mm_prefetch(in_order + 2 * kQuads * c + 64 * j, _MM_HINT_T0);
        if (ahead != nullptr)
          for (int j = 0; j < 2 * kQuads; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * n + c), _MM_HINT_T0);
        for (int u = 0; u < kQuads; ++u) {
          const __m512i a = _mm512_xor_si512(_mm512_loadu_si512(rows[2 * u] + c), flip);
          const __m512i b = _mm512_xor_si512(_mm512_loadu_si512(rows[2 * u + 1] + c), flip);
          __m512i q[4];
          to_quads(_mm512_and_si512(a, nib), _mm512_and_si512(_mm512_srli_epi16(a, 4), nib),
                   _mm512_and_si512(b, nib), _mm512_and_si512(_mm512_srli_epi16(b, 4), nib), q);
          for (int r = 0; r < R; ++r) {
            const __m512i xv = _mm512_set1_epi32(xw[u][r]);
            for (int t = 0; t < 4; ++t) s[r][t] = _mm512_dpbusd_epi32(s[r][t], q[t], xv);
          }
        }
        for (int r = 0; r < R; ++r) {
          if (!last) {
            for (int t = 0; t < 4; ++t) _mm512_storeu_si512(sums + r * width + (c - n0) + 16 * t, s[r][t]);
            continue;
          }
          __m512i ordered[4];
          in_order_lanes(s[r], ordered);
          float* y = out + r * n + c;
          for (int t = 0; t < 4; ++t) {
            const __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ordered[t], corr[r])),
                                              _mm512_loadu_ps(sg + c + 16 * t));
            _mm512_storeu_ps(y + 16 * t, g == 0 ? term : _mm512_add_ps(_mm512_loadu_ps(y + 16 * t), term));
          }
        }
      }
    }
  }
}

}  // namespace

void int8_vnni(const int8_t* x, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1,
               int32_t* acc) {
  const int64_t simd_end = k > 0 ? n0 + (n1 - n0) / kChunk * kChunk : n0;
  if (simd_end > n0) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) int8_rows<4>(x + r * k, k, w, n, n0, simd_end, acc + r * n);
    for (; r + 2 <= m; r += 2) int8_rows<2>(x + r * k, k, w, n, n0, simd_end, acc + r * n);
    for (; r < m; ++r) int8_rows<1>(x + r * k, k, w, n, n0, simd_end, acc + r * n);
  }
  if (simd_end < n1) int8_avx2(x, m, k, w, n, simd_end, n1, acc);
}

void int4_vnni(const int8_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
               const float* scale, int64_t n0, int64_t n1, float* out) {
  const bool quads_ok = block >= k || block % 4 == 0;
  const int64_t simd_end = quads_ok ? n0 + (n1 - n0) / kChunk * kChunk : n0;
  if (simd_end > n0) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) int4_stream<4>(x + r * k, k, w, n, block, scale, n0, simd_end, out + r * n);
    for (; r + 2 <= m; r += 2) int4_stream<2>(x + r * k, k, w, n, block, scale, n0, simd_end, out + r * n);
    for (; r < m; ++r) int4_stream<1>(x + r * k, k, w, n, block, scale, n0, simd_end, out + r * n);
  }
  if (simd_end < n1) int4_avx2(x, m, k, w, n, block, scale, simd_end, n1, out);
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
