// AVX2 streaming variants (the weights read once per pass, in their stored layout; the GEMM for
// many rows of int8 is gemm_avx2.cc).
// int8: each pair of K rows is sign-extended to 16 bits and interleaved, so one vpmaddwd
// multiplies 16 weights by a broadcast (x[k], x[k+1]) pair and adds the two products into 8
// int32 lanes: exact for every int8 value (no saturation, unlike vpmaddubsw). Columns are
// processed in chunks of 16 (two 8-lane accumulators whose lanes come out in the order
// [0-3, 8-11] and [4-7, 12-15], put back in order on store); several rows of x share each loaded
// pair of weight rows. One or two rows of x within [-127, 127] (all the quantizer makes) take
// int8_stream_bytes instead: bytes multiplied as bytes (vpmaddubsw), 16 rows a pass (8 over ranges
// wider than kNarrowColumns).
// int4: vpmaddubsw on the nibbles + 8 (unsigned, at most 15: exact here), see int4_stream.
//
// Everything before the target pragma is compiled for the baseline ISA, so no AVX2 code leaks
// into inline functions shared with the portable path.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
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

// Whether none of the R rows of x holds -128: the quantizer's range ([-127, 127]), where the
// byte-product kernel below is exact.
template <int R>
bool within_127(const int8_t* x, int64_t k) {
  for (int64_t i = 0; i < R * k; ++i)
    if (x[i] == -128) return false;
  return true;
}

// The int32 sums of 32 columns as the unpacks leave them ([0-3|16-19], [4-7|20-23],
// [8-11|24-27], [12-15|28-31]) in column order: out[q] holds columns 8q .. 8q + 7.
inline void in_order32(const __m256i* s, __m256i (&out)[4]) {
  out[0] = _mm256_permute2x128_si256(s[0], s[1], 0x20);
  out[1] = _mm256_permute2x128_si256(s[2], s[3], 0x20);
  out[2] = _mm256_permute2x128_si256(s[0], s[1], 0x31);
  out[3] = _mm256_permute2x128_si256(s[2], s[3], 0x31);
}

// Puts the sums of columns [n0, n1), kept in that order per chunk of 32, back in column order.
inline void unpermute32(int32_t* row, int64_t n0, int64_t n1) {
  for (int64_t c = n0; c < n1; c += 32) {
    __m256i* p = reinterpret_cast<__m256i*>(row + c);
    const __m256i s[4] = {_mm256_loadu_si256(p), _mm256_loadu_si256(p + 1), _mm256_loadu_si256(p + 2),
                          _mm256_loadu_si256(p + 3)};
    __m256i ordered[4];
    in_order32(s, ordered);
    for (int q = 0; q < 4; ++q) _mm256_storeu_si256(p + q, ordered[q]);
  }
}

// R rows of x, each within [-127, 127], times columns [n0, n1) (a multiple of 32 wide), the
// weights streamed 4 * Q rows a pass (each row front to back, the sums of a pass in registers;
// over narrow ranges the next pass's rows prefetched while this one runs). Each quad of rows'
// bytes of a column is interleaved in registers (two rounds of unpacks, as the VNNI path does),
// and each product is
// |w| times x with w's sign, through vpmaddubsw: |w| <= 128 as an unsigned byte and |x| <= 127,
// so a pair of products is at most 2 * 128 * 127 = 32512 and never saturates; vpmaddwd by ones
// adds a column's two pairs into its int32 sum. 32 bytes of weights cost 2 shuffles and 5 other
// instructions where widening them to 16 bits for vpmaddwd (int8_stream) costs 4 shuffles and 6
// others. x = -128 would turn the sign the wrong way (-(-128) is -128 in a byte): int8_rows
// checks, and sends such rows to int8_stream, exact for every int8 value. The quantizer never
// makes -128.
// Measured on a SmolLM2-135M decode step (2-core Xeon with AVX-512, VNNI and AMX, the AVX2 path
// forced with AUTOPOLICY_CPU_PATH=avx2, int8 everywhere): 2.02-2.05x float32's speed with
// int8_stream alone, 2.69-2.81x with this kernel.
// Over ranges of at most kNarrowColumns (a decoder's projections, where the prefetched rows are
// read microseconds later) a pass takes 16 rows; wider ones (a 4096-column layer, an output head)
// take 8 rows a pass and leave their long rows to the hardware prefetchers. Wide ranges went to
// int8_stream before (four rows a pass): this kernel with 8 rows a pass was 1.04-1.12x faster on
// a 4096 x 4096 layer at batch 1 and 1.09-1.16x at 2 (three runs), 1.20x at 3 (one run), and
// 1.01-1.06x on the 576 x 49152 head at batch 1-3 (two runs): benchmarks/ab_cpu_kernels.py
// --layers, 41 rounds a run, on a 2-core Zen 3 EPYC (AVX2, FMA; no AVX-512); the int4 layers,
// unchanged, 0.97-1.01x; with 4 rows a pass it was 0.91-0.95x.
constexpr int kBytePassQuads = 4;      // quads of K rows a pass over narrow ranges: 16 rows
constexpr int kWideBytePassQuads = 2;  // and over wide ones: 8 rows
// Over wide ranges each row's line kWideLead bytes ahead is fetched (from c + kWideLead past the
// range's end: the same line of the next pass's row), so the hardware prefetchers, which start
// afresh at each 4 KB page, are not left to ramp up at every row: 1.10-1.14x on a 4096 x 4096
// layer at batch 1 and 1.03-1.12x at 2, 1.04-1.14x and 1.05-1.10x on the head (three runs, the
// same machine and harness as above; the unchanged int4 layers 0.99-1.03x). A lead of 512 bytes
// ran at 0.93-0.97x of 256's speed, one of 2048 at 0.79-0.88x of 512's, 64 and 128 about as 512.
constexpr int64_t kWideLead = 256;

template <int R, int Q>
void int8_stream_bytes(const int8_t* x, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1,
                       int32_t* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < k; i += 4 * Q) {
    const bool first = i == 0;
    const int8_t* rows[4 * Q];
    for (int j = 0; j < 4 * Q; ++j) rows[j] = i + j < k ? w + (i + j) * n : w;  // past K: x is 0 there
    __m256i xq[Q][R];
    for (int u = 0; u < Q; ++u)
      for (int r = 0; r < R; ++r) {
        xq[u][r] = _mm256_set1_epi32(quad_of(x + r * k, i + 4 * u, k));
      }
    // The next pass's rows (narrow ranges), fetched while this one runs. Over whole rows (n0 = 0,
    // n1 = n) they are one contiguous stretch of 4 * Q * n bytes, fetched line by line in order,
    // 4 * Q * 32 bytes of it per 32 columns of this pass; over part of each row, one line of each
    // row per 64 columns. A bare read of a 576 x 576 layer's bytes in this order (16 rows, 32
    // bytes of each a step) took 52-56 us with the row-by-row fetch and 30-36 us with the in-order
    // one, 27-34 us read front to back (one thread, 64 copies in turn, 2-core Zen 3 EPYC). In the
    // kernel, with 8 rows a pass (int8_rows), against the row-by-row fetch and 16 rows:
    // 1.14-1.15x (median of eight layer shapes and batches, 576 x 576 to 1536 x 576, batch 1 and
    // 2, two runs of benchmarks/ab_cpu_kernels.py --layers, 41 rounds; an A/A pair 0.99-1.00x);
    // with 16 rows a pass 1.07-1.13x; fetching two passes ahead 0.87-0.99x (eight shapes, one run).
    const bool narrow = n1 - n0 <= kNarrowColumns, next_pass = i + 8 * Q <= k;
    const bool whole = whole_rows(n0, n1, n);
    const char* in_order = narrow && next_pass && whole ? reinterpret_cast<const char*>(w + (i + 4 * Q) * n) : nullptr;
    const int8_t* ahead = narrow && next_pass && !whole ? w + (i + 4 * Q) * n : nullptr;
    const bool lead = !narrow && next_pass;
    for (int64_t c = n0; c < n1; c += 32) {
      if (in_order != nullptr)
        for (int q = 0; q < 2 * Q; ++q) _mm_prefetch(in_order + 4 * Q * c + 64 * q, _MM_HINT_T0);
      if (ahead != nullptr && ((c - n0) & 32) == 0)
        for (int j = 0; j < 4 * Q; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * n + c), _MM_HINT_T0);
      if (lead && ((c - n0) & 32) == 0) {
        const int64_t d = c + kWideLead;
        for (int j = 0; j < 4 * Q; ++j) {
          const int8_t* p = d < n1 ? rows[j] + d : rows[j] + 4 * Q * n + (d - (n1 - n0));
          _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
        }
      }
      __m256i s[R][4];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < 4; ++t)
          s[r][t] = first ? _mm256_setzero_si256()
                          : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + r * n + c + 8 * t));
      for (int u = 0; u < Q; ++u) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[4 * u] + c));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[4 * u + 1] + c));
        const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[4 * u + 2] + c));
        const __m256i f = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[4 * u + 3] + c));
        const __m256i ab_lo = _mm256_unpacklo_epi8(a, b), ab_hi = _mm256_unpackhi_epi8(a, b);
        const __m256i ef_lo = _mm256_unpacklo_epi8(e, f), ef_hi = _mm256_unpackhi_epi8(e, f);
        const __m256i quads[4] = {_mm256_unpacklo_epi16(ab_lo, ef_lo), _mm256_unpackhi_epi16(ab_lo, ef_lo),
                                  _mm256_unpacklo_epi16(ab_hi, ef_hi), _mm256_unpackhi_epi16(ab_hi, ef_hi)};
        for (int t = 0; t < 4; ++t) {
          const __m256i magnitude = _mm256_abs_epi8(quads[t]);
          for (int r = 0; r < R; ++r) {
            const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xq[u][r], quads[t]));
            s[r][t] = _mm256_add_epi32(s[r][t], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < 4; ++t)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * n + c + 8 * t), s[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) unpermute32(acc + r * n, n0, n1);
}

template <int R>
void int8_rows(const int8_t* x, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1, int32_t* acc) {
  // Four rows of x would need 16 sums of 8 lanes: more registers than there are.
  if (R <= 2 && n1 - n0 >= 32 && within_127<R>(x, k)) {
    const int64_t end = n0 + (n1 - n0) / 32 * 32;
    // Narrow ranges of whole rows (a decoder projection's K slab, or all of a small one) take 8
    // rows a pass and fetch the next pass in order (see int8_stream_bytes); other narrow ranges 16.
    if (n1 - n0 <= kNarrowColumns && !whole_rows(n0, end, n))
      int8_stream_bytes<R, kBytePassQuads>(x, k, w, n, n0, end, acc);
    else
      int8_stream_bytes<R, kWideBytePassQuads>(x, k, w, n, n0, end, acc);
    n0 = end;  // the rest (fewer than 32 columns) as below
  }
  const int64_t simd_end = n0 + (n1 - n0) / 16 * 16;
  if (simd_end > n0) int8_stream<R>(x, k, w, n, n0, simd_end, acc);
  if (simd_end < n1) {  // the last columns, fewer than 16
    for (int r = 0; r < R; ++r) int8_portable(x + r * k, 1, k, w, n, simd_end, n1, acc + r * n);
  }
}

// R rows of x times columns [n0, n1) (a multiple of 32 wide) of a packed int4 kernel. Byte row j
// holds rows (2j, 2j + 1) in its (low, high) nibbles; each nibble v becomes u = v + 8 (0..15, an
// unsigned byte: the nibble xor 8), and vpmaddubsw multiplies the interleaved (u[2j], u[2j + 1])
// bytes of a column by the broadcast (x[2j], x[2j + 1]) and adds the pair into one int16: at most
// 2 * 15 * 128 = 3840 in size, so it never saturates, and 8 byte rows sum in int16 (at most
// 30720) before they are widened into int32 sums in memory. The sums are of u * x; the block's
// sum(w * x) is that minus 8 * sum(x) over the block, exact. When a block ends its int32 sums are
// converted to float, times the scales, and added into the output in block order (the portable
// path's operations). About 14 instructions per 32 weight bytes, where widening to 16 bits
// before vpmaddwd took 28: the kernel at batch 1 is no longer bound by the instructions.
// Sums are kept per 32 columns as [0-3|16-19], [4-7|20-23], [8-11|24-27], [12-15|28-31] (the
// lane order of the unpacks), put back in order when a block ends.
// Blocks shorter than K (kBlocked: int4/<block>) end inside their last pass: each chunk's sums,
// complete there and still in registers, go into the output at once, and the block's first pass
// writes its sums without reading any back, so no pass clears the sums and none re-reads them at
// the block's end. Against that separate pass, with blocks of 32 (benchmarks/ab_cpu_kernels.py,
// kernel alone, 31 rounds, two runs, 2-core AMD EPYC Zen 3, AVX2): 1.04-1.09x on 4096 x 4096 and
// the 576 x 49152 head at batch 1, 1.11-1.19x at batch 2, 1.01-1.16x at batches 4 and 8; the
// narrow shapes 0.92-1.06x, within the A/A spread. Per channel keeps the separate pass: the same
// code run there (flags tested at run time) was 0.86-0.95x on those two shapes.
template <int R, bool kBlocked>
void int4_stream(const int8_t* x, int64_t k, const uint8_t* w, int64_t n, int64_t block, const float* scale,
                 int64_t n0, int64_t n1, float* out, int32_t* sums) {
  const int64_t pairs = (k + 1) / 2, width = n1 - n0;
  const int64_t groups = (k + block - 1) / block;
  const int64_t block_pairs = groups == 1 ? pairs : block / 2;  // blocks are even or one
  const __m256i nib = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x88));
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t j0 = g * block_pairs, j1 = std::min(pairs, j0 + block_pairs);
    const float* block_scale = scale + g * n;
    if (!kBlocked) std::memset(sums, 0, R * width * sizeof(int32_t));
    int32_t correction[R];
    for (int r = 0; r < R; ++r) {
      int32_t total = 0;
      for (int64_t i = 2 * j0; i < std::min(k, 2 * j1); ++i) total += x[r * k + i];
      correction[r] = 8 * total;
    }
    for (int64_t jg = j0; jg < j1; jg += 8) {
      const int64_t rows = std::min<int64_t>(8, j1 - jg);
      // The block's first pass starts its sums (none to read back); its last adds them, rescaled,
      // into the output; passes between keep them in `sums`.
      const bool first = kBlocked && jg == j0, last = kBlocked && jg + 8 >= j1;
      __m256i xb[8][R];
      const uint8_t* wrow[8];
      for (int64_t jj = 0; jj < rows; ++jj) {
        const int64_t j = jg + jj;
        wrow[jj] = w + j * n;
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = x + r * k;
          const int32_t x0 = static_cast<uint8_t>(xr[2 * j]);
          const int32_t x1 = 2 * j + 1 < k ? static_cast<uint8_t>(xr[2 * j + 1]) : 0;  // odd K: the pad row is 0
          xb[jj][r] = _mm256_set1_epi16(static_cast<int16_t>(x0 | (x1 << 8)));
        }
      }
      // The next pass's byte rows, fetched while this one runs (one line of each per 64 columns),
      // over narrow ranges as int8_stream_bytes does.
      // Over wide ranges (the output head) each row's line kWideLead bytes ahead instead, as
      // int8_stream_bytes does: 1.06-1.08x on the 576 x 49152 head at batch 1, 1.02-1.04x at 2
      // (two runs); over narrow ranges that lead in place of the next pass was 0.95-0.97x. For
      // int4 too 256 bytes was the best lead: 128, 512 and 1024 ran at 0.76-0.96x of its speed
      // (4096 x 4096 slabs and the head, batch 1, one run each).
      const bool narrow = width <= kNarrowColumns;
      // Over whole rows (per-channel int4's K slabs: a 4096 x 4096 layer's rows are 4 KB each, a
      // 576-wide projection's 576 bytes) the next pass's 8 rows are one contiguous stretch; it is
      // fetched line by line in order, 256 bytes of it per 32 columns of this pass, so it has all
      // arrived when the pass ends. Over narrow whole rows, in place of each row's line a pass
      // ahead, together with K slabs from 512 rows (ffi.cc): 1.09-1.13x (medians of the same eight
      // shapes and batches as int8_stream_bytes', two runs; int8 unchanged 1.02-1.03x). Paired
      // against each row's line 256 bytes ahead (benchmarks/ab_cpu_kernels.py --layers, 41
      // rounds a run, four runs, 2-core Zen 3 EPYC, AVX2): 4096 x 4096 int4 0.98-1.05x at batch 1
      // (A/A 0.96-0.99x), 1.06-1.10x at 2 (A/A 0.98-1.03x). Fetched to L2 (T1) it was 0.99-1.00x
      // at batch 1, NTA 1.00-1.04x.
      const bool full_pass = jg + 16 <= j1 && rows == 8;  // a next pass of 8 rows in range
      const bool whole = whole_rows(n0, n1, n);
      const uint8_t* block_ahead = full_pass && whole ? w + (jg + 8) * n : nullptr;
      const bool lead = !narrow && full_pass && !whole;
      const uint8_t* ahead = narrow && block_ahead == nullptr && jg + 16 <= pairs ? w + (jg + 8) * n : nullptr;
      for (int64_t c = n0; c < n1; c += 32) {
        if (block_ahead != nullptr) {
          const char* p = reinterpret_cast<const char*>(block_ahead + 8 * (c - n0));
          for (int q = 0; q < 4; ++q) _mm_prefetch(p + 64 * q, _MM_HINT_T0);
        }
        if (ahead != nullptr && ((c - n0) & 32) == 0)
          for (int j = 0; j < 8; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * n + c), _MM_HINT_T0);
        if (lead && ((c - n0) & 32) == 0) {
          const int64_t d = c + kWideLead;
          for (int j = 0; j < 8; ++j) {
            const uint8_t* p = d < n1 ? wrow[j] + d : wrow[j] + 8 * n + (d - width);
            _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
          }
        }
        __m256i t0[R], t1[R];
        for (int r = 0; r < R; ++r) t0[r] = t1[r] = _mm256_setzero_si256();
        for (int64_t jj = 0; jj < rows; ++jj) {
          const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow[jj] + c)), flip);
          const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
          const __m256i u0 = _mm256_unpacklo_epi8(lo, hi), u1 = _mm256_unpackhi_epi8(lo, hi);
          for (int r = 0; r < R; ++r) {
            t0[r] = _mm256_add_epi16(t0[r], _mm256_maddubs_epi16(u0, xb[jj][r]));
            t1[r] = _mm256_add_epi16(t1[r], _mm256_maddubs_epi16(u1, xb[jj][r]));
          }
        }
        for (int r = 0; r < R; ++r) {
          __m256i* p = reinterpret_cast<__m256i*>(sums + r * width + (c - n0));
          __m256i parts[4] = {_mm256_srai_epi32(_mm256_unpacklo_epi16(t0[r], t0[r]), 16),
                              _mm256_srai_epi32(_mm256_unpackhi_epi16(t0[r], t0[r]), 16),
                              _mm256_srai_epi32(_mm256_unpacklo_epi16(t1[r], t1[r]), 16),
                              _mm256_srai_epi32(_mm256_unpackhi_epi16(t1[r], t1[r]), 16)};
          if (!first)
            for (int q = 0; q < 4; ++q) parts[q] = _mm256_add_epi32(_mm256_loadu_si256(p + q), parts[q]);
          if (!last) {
            for (int q = 0; q < 4; ++q) _mm256_storeu_si256(p + q, parts[q]);
            continue;
          }
          // The block's last pass: its sums, complete, go straight into the output.
          __m256i ordered[4];
          in_order32(parts, ordered);
          const __m256i corr = _mm256_set1_epi32(correction[r]);
          float* y = out + r * n + c;
          for (int q = 0; q < 4; ++q) {
            const __m256 term = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ordered[q], corr)),
                                              _mm256_loadu_ps(block_scale + c + 8 * q));
            _mm256_storeu_ps(y + 8 * q, g == 0 ? term : _mm256_add_ps(_mm256_loadu_ps(y + 8 * q), term));
          }
        }
      }
    }
    if (kBlocked) continue;
    for (int r = 0; r < R; ++r) {
      float* y = out + r * n;
      const __m256i corr = _mm256_set1_epi32(correction[r]);
      for (int64_t c = n0; c < n1; c += 32) {
        const __m256i* p = reinterpret_cast<const __m256i*>(sums + r * width + (c - n0));
        const __m256i s4[4] = {_mm256_loadu_si256(p), _mm256_loadu_si256(p + 1), _mm256_loadu_si256(p + 2),
                               _mm256_loadu_si256(p + 3)};
        __m256i ordered[4];
        in_order32(s4, ordered);
        for (int q = 0; q < 4; ++q) {
          const __m256 term = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ordered[q], corr)),
                                            _mm256_loadu_ps(block_scale + c + 8 * q));
          _mm256_storeu_ps(y + c + 8 * q, term);
        }
      }
    }
  }
}

template <bool kBlocked>
void int4_rows(const int8_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block, const float* scale,
               int64_t n0, int64_t n1, float* out, int32_t* sums) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) int4_stream<4, kBlocked>(x + r * k, k, w, n, block, scale, n0, n1, out + r * n, sums);
  for (; r + 2 <= m; r += 2) int4_stream<2, kBlocked>(x + r * k, k, w, n, block, scale, n0, n1, out + r * n, sums);
  for (; r < m; ++r) int4_stream<1, kBlocked>(x + r * k, k, w, n, block, scale, n0, n1, out + r * n, sums);
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
  const int64_t simd_end = n0 + (n1 - n0) / 32 * 32;
  if (simd_end > n0) {
    // Uninitialized: int4_stream clears the sums (per channel) or writes them first (blocked); a
    // zeroed vector was a second memset of up to 24 KB a call, 1.3% of a SmolLM2 int4 decode
    // step's CPU time in perf.
    std::unique_ptr<int32_t[]> scratch(new int32_t[static_cast<size_t>(4 * (simd_end - n0))]);
    if (k > block)
      int4_rows<true>(x, m, k, w, n, block, scale, n0, simd_end, out, scratch.get());
    else
      int4_rows<false>(x, m, k, w, n, block, scale, n0, simd_end, out, scratch.get());
  }
  if (simd_end < n1) int4_portable(x, m, k, w, n, block, scale, simd_end, n1, out);
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
