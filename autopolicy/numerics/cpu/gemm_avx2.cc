// The AVX2 GEMMs for many rows of x (M >= gemm_min_rows()), on gemm_tiles.h's drivers.
// int8: K rows go in pairs: x packed as one int32 word of two int16 per pair (pack_x_pairs), the
// weights as two int16 per pair of a column; the micro-kernel holds a 4 x 24 tile of int32 sums
// in 12 YMM registers and per K pair loads 3 weight vectors, broadcasts 4 x words, and runs 12
// vpmaddwd (exact for every int8 value, -128 included: unlike vpmaddubsw nothing saturates) and
// 12 vpaddd.
// int4: K rows go in quads, laid out as the vpdpbusd GEMMs lay them out (x as signed bytes, each
// weight nibble offset to unsigned, v + 8 in [0, 15]); vpmaddubsw multiplies each weight byte by
// its x byte and adds neighbours into int16 lanes, 32 products an instruction where vpmaddwd makes
// 16. Nothing saturates: a lane's two products come to at most 2 * 15 * 128 = 3840 in magnitude,
// so eight quads (32 K rows) add up in int16 below 32768, and then one vpmaddwd by ones widens a
// column's two lanes into its int32 sum. The offset (8 times each row's sum of x over the block)
// starts the sums at minus it, as on VNNI.
// Everything before the target pragma is compiled for the baseline ISA.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace autopolicy_cpu {

namespace {
// Pair p of a row of x (k long) as one word: (x[2p], x[2p + 1]) as two int16 (low: even row; the
// pad of an odd K is zero).
inline int32_t pair_word(const int8_t* row, int64_t p, int64_t k) {
  const int32_t lo = row[2 * p], hi = 2 * p + 1 < k ? row[2 * p + 1] : 0;
  return static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) | (static_cast<uint32_t>(hi) << 16));
}
}  // namespace

void pack_x_pairs(const int8_t* x, int64_t m, int64_t k, int32_t* a) {
  const int64_t pairs = (k + 1) / 2, panels = (m + kGemmRows - 1) / kGemmRows;
  for (int64_t panel = 0; panel < panels; ++panel) {
    int32_t* dst = a + panel * pairs * kGemmRows;
    for (int64_t rr = 0; rr < kGemmRows; ++rr) {
      const int64_t r = panel * kGemmRows + rr;
      if (r >= m) {
        for (int64_t p = 0; p < pairs; ++p) dst[p * kGemmRows + rr] = 0;
        continue;
      }
      const int8_t* row = x + r * k;
      for (int64_t p = 0; p < pairs; ++p) dst[p * kGemmRows + rr] = pair_word(row, p, k);
    }
  }
}

#if defined(__x86_64__)
void pack_x_pairs_avx2(const int8_t* x, int64_t m, int64_t k, int32_t* a);
#endif

namespace {
int64_t pairs_words(int64_t m, int64_t k, int64_t) { return (m + kGemmRows - 1) / kGemmRows * kGemmRows * ((k + 1) / 2); }
// Rows [r0, r1) (x holds them alone): their panels are whole panels of a pack of those rows
// alone, r0 * pairs words in.
void pack_pairs(const int8_t* x, int64_t, int64_t k, int64_t, int64_t r0, int64_t r1, int32_t* a) {
#if defined(__x86_64__)
  pack_x_pairs_avx2(x, r1 - r0, k, a + r0 * ((k + 1) / 2));  // kPairsX is the AVX2 path's
#else
  pack_x_pairs(x, r1 - r0, k, a + r0 * ((k + 1) / 2));
#endif
}
}  // namespace

const GemmX kPairsX{kGemmRows, kGemmStrip, 2, pairs_words, pack_pairs};

}  // namespace autopolicy_cpu

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "gemm_tiles.h"

namespace autopolicy_cpu {

// pack_x_pairs with whole panels' pairs four at a time: eight bytes of each of the panel's four
// rows sign-extended to int16 (four pair words a row), then the 4 x 4 words transposed so that
// each pair's words of the four rows lie together. The rest (a panel past m, the last pairs of a
// row) as pack_x_pairs writes them. The plain loop, a byte at a time, took a tenth of a
// 1024 x 1536 x 384 int8 dense call's time on its calling thread (perf, 2-core Zen 3 EPYC, AVX2).
void pack_x_pairs_avx2(const int8_t* x, int64_t m, int64_t k, int32_t* a) {
  const int64_t pairs = (k + 1) / 2, whole_panels = m / kGemmRows, vector_pairs = k / 8 * 4;
  static_assert(kGemmRows == 4, "the transpose below is 4 x 4 words");
  for (int64_t panel = 0; panel < whole_panels; ++panel) {
    int32_t* dst = a + panel * pairs * kGemmRows;
    const int8_t* row = x + panel * kGemmRows * k;
    for (int64_t p = 0; p < vector_pairs; p += 4) {
      __m128i r[4];
      for (int rr = 0; rr < 4; ++rr)
        r[rr] = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + rr * k + 2 * p)));
      const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpacklo_epi32(r[2], r[3]);
      const __m128i t2 = _mm_unpackhi_epi32(r[0], r[1]), t3 = _mm_unpackhi_epi32(r[2], r[3]);
      __m128i* out = reinterpret_cast<__m128i*>(dst + p * kGemmRows);
      _mm_storeu_si128(out, _mm_unpacklo_epi64(t0, t1));
      _mm_storeu_si128(out + 1, _mm_unpackhi_epi64(t0, t1));
      _mm_storeu_si128(out + 2, _mm_unpacklo_epi64(t2, t3));
      _mm_storeu_si128(out + 3, _mm_unpackhi_epi64(t2, t3));
    }
    for (int64_t p = vector_pairs; p < pairs; ++p)
      for (int64_t rr = 0; rr < kGemmRows; ++rr) dst[p * kGemmRows + rr] = pair_word(row + rr * k, p, k);
  }
  if (whole_panels * kGemmRows < m)  // the last, partial panel
    pack_x_pairs(x + whole_panels * kGemmRows * k, m - whole_panels * kGemmRows, k, a + whole_panels * pairs * kGemmRows);
}

namespace {

constexpr int64_t NR = kGemmStrip;

// The weights of K pairs [p0, p1) and columns [c0, c1) as strips of NR columns ([strip][pair][NR]
// int32 words, the columns past c1 zero). int8: rows 2p and 2p + 1 (a row past K is zero).
void pack_int8(const int8_t* w, int64_t k, int64_t n, int64_t p0, int64_t p1, int64_t c0, int64_t c1, int32_t* b) {
  const int64_t pairs = p1 - p0, width = c1 - c0;
  const int64_t strips = (width + NR - 1) / NR;
  const __m128i zero = _mm_setzero_si128();
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* r0 = w + 2 * p * n;
    const int8_t* r1 = 2 * p + 1 < k ? r0 + n : nullptr;
    for (int64_t s = 0; s < strips; ++s) {
      int32_t* dst = b + (s * pairs + (p - p0)) * NR;
      for (int64_t g = 0; g < NR; g += 8) {
        const int64_t c = c0 + s * NR + g;
        if (c + 8 <= c1) {
          const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r0 + c));
          const __m128i e = r1 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r1 + c)) : zero;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + g), _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, e)));
        } else {
          for (int64_t j = 0; j < 8; ++j) {
            const int64_t col = c + j;
            const int32_t lo = col < c1 ? r0[col] : 0, hi = col < c1 && r1 ? r1[col] : 0;
            dst[g + j] = static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) | (static_cast<uint32_t>(hi) << 16));
          }
        }
      }
    }
  }
}

struct MaddPairs {  // vpmaddwd: two int16 products a lane, exact; vpaddd into the sums
  static inline __m256i add(__m256i sums, __m256i w, __m256i x) {
    return _mm256_add_epi32(sums, _mm256_madd_epi16(w, x));
  }
};

struct Avx2Pairs : Ymm4x24<MaddPairs> {
  static constexpr int64_t KG = 2, kDepthRows = kGemmDepth, kPanelBytes = kGemmPanelBytes;
  static constexpr uint32_t kOffset8 = 0, kOffset4 = 0;  // vpmaddwd takes signed pairs as they are
  static constexpr bool kPrefetchSums = true;

  static void pack8(const int8_t* w, int64_t k, int64_t n, int64_t g0, int64_t g1, int64_t c0, int64_t c1, uint8_t* b) {
    pack_int8(w, k, n, g0, g1, c0, c1, reinterpret_cast<int32_t*>(b));
  }
};
static_assert(Avx2Pairs::MR == kGemmRows && Avx2Pairs::NR == kGemmStrip, "kernels.h's tile");

// int4 on vpmaddubsw: a tile of 6 x 16 int32 sums, each run of up to kRun quads of K rows added
// in 12 int16 sums that then widen into the int32 ones.
constexpr int64_t kInt4Rows = 6, kInt4Strip = 16;
constexpr int64_t kRun = 8;  // 8 * 3840 < 32768

// One run of `run` quads (1 to kRun): c (6 x 2 int32 vectors, in memory) += the products. In
// assembly: per quad, the strip's 2 weight vectors loaded; per row, a broadcast of its x word
// and 2 vpmaddubsw (unsigned weights by signed x), each added into its int16 sum: the 12 sums, 2
// weight vectors, the broadcast and a product are the 16 YMM registers. gcc 12 spilled the sums
// of the same loop written with intrinsics. One core of the 2-core Zen 3 EPYC, strips in L1,
// nine alternated timings each (G products/s, medians): this 6 x 16 tile 112, 4 x 16 and 3 x 24
// (weights held) 98, 4 x 24 (weights reloaded each row, the registers being short) 87, and the
// 4 x 24 loop in intrinsics 34-39.
#define AP_INT4_ROW(xoff, h0, h1)                                                               \
  "vpbroadcastd " xoff "(%[a]), %%ymm14\n\t"                                                     \
  "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\tvpaddw %%ymm15, %%ymm" h0 ", %%ymm" h0 "\n\t"          \
  "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\tvpaddw %%ymm15, %%ymm" h1 ", %%ymm" h1 "\n\t"
#define AP_INT4_WIDEN(off, h)                                                              \
  "vpmaddwd %%ymm15, %%ymm" h ", %%ymm" h "\n\tvpaddd " off "(%[c]), %%ymm" h ", %%ymm" h "\n\t" \
  "vmovdqu %%ymm" h ", " off "(%[c])\n\t"
#define AP_INT4_CLOBBERS                                                                                        \
  "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
      "xmm12", "xmm13", "xmm14", "xmm15"
#define AP_INT4_LOOP                                                                                            \
  "vpxor %%xmm0, %%xmm0, %%xmm0\n\tvpxor %%xmm1, %%xmm1, %%xmm1\n\tvpxor %%xmm2, %%xmm2, %%xmm2\n\t"             \
  "vpxor %%xmm3, %%xmm3, %%xmm3\n\tvpxor %%xmm4, %%xmm4, %%xmm4\n\tvpxor %%xmm5, %%xmm5, %%xmm5\n\t"             \
  "vpxor %%xmm6, %%xmm6, %%xmm6\n\tvpxor %%xmm7, %%xmm7, %%xmm7\n\tvpxor %%xmm8, %%xmm8, %%xmm8\n\t"             \
  "vpxor %%xmm9, %%xmm9, %%xmm9\n\tvpxor %%xmm10, %%xmm10, %%xmm10\n\tvpxor %%xmm11, %%xmm11, %%xmm11\n\t"        \
  "1:\n\t"                                                                                                     \
  "vmovdqu (%[b]), %%ymm12\n\tvmovdqu 32(%[b]), %%ymm13\n\t"                                                    \
  AP_INT4_ROW("0", "0", "1") AP_INT4_ROW("4", "2", "3") AP_INT4_ROW("8", "4", "5")                              \
  AP_INT4_ROW("12", "6", "7") AP_INT4_ROW("16", "8", "9") AP_INT4_ROW("20", "10", "11")                         \
  "add $24, %[a]\n\tadd $64, %[b]\n\tdec %[n]\n\tjnz 1b\n\t"                                                  \
  "vpcmpeqw %%ymm15, %%ymm15, %%ymm15\n\tvpsrlw $15, %%ymm15, %%ymm15\n\t"
__attribute__((noinline)) void int4_run(const int32_t* a, const uint8_t* b, int64_t run, __m256i* c) {
  static_assert(kInt4Rows == 6 && kInt4Strip == 16, "the assembly is a 6 x 16 tile");
  asm volatile(
      AP_INT4_LOOP
      AP_INT4_WIDEN("0", "0") AP_INT4_WIDEN("32", "1") AP_INT4_WIDEN("64", "2") AP_INT4_WIDEN("96", "3")
      AP_INT4_WIDEN("128", "4") AP_INT4_WIDEN("160", "5") AP_INT4_WIDEN("192", "6") AP_INT4_WIDEN("224", "7")
      AP_INT4_WIDEN("256", "8") AP_INT4_WIDEN("288", "9") AP_INT4_WIDEN("320", "10") AP_INT4_WIDEN("352", "11")
      : [a] "+r"(a), [b] "+r"(b), [n] "+r"(run)
      : [c] "r"(c)
      : AP_INT4_CLOBBERS);
}
// The same run ending a block of a whole tile: its sums (c's plus the run's) to float, times the
// block's scales (s: 16 floats), stored into the 6 rows of out (o, a row every l bytes; p = o +
// 3 l) or added to them: the float operations of ymm_scale_tile, in its order. Ends the blocks of
// a short block (int4/32: one run a block) without the tile's int32 sums going through memory
// twice and a pass of their own.
#define AP_INT4_END(add, off, h, sj, out)                                                      \
  "vpmaddwd %%ymm15, %%ymm" h ", %%ymm" h "\n\tvpaddd " off "(%[c]), %%ymm" h ", %%ymm" h "\n\t" \
  "vcvtdq2ps %%ymm" h ", %%ymm" h "\n\tvmulps " sj "(%[s]), %%ymm" h ", %%ymm" h "\n\t"          \
  add(out, h) "vmovups %%ymm" h ", " out "\n\t"
#define AP_INT4_STORE(out, h) ""
#define AP_INT4_ADD(out, h) "vaddps " out ", %%ymm" h ", %%ymm" h "\n\t"
#define AP_INT4_ENDS(add)                                                                           \
  AP_INT4_END(add, "0", "0", "0", "(%[o])") AP_INT4_END(add, "32", "1", "32", "32(%[o])")           \
  AP_INT4_END(add, "64", "2", "0", "(%[o],%[l])") AP_INT4_END(add, "96", "3", "32", "32(%[o],%[l])") \
  AP_INT4_END(add, "128", "4", "0", "(%[o],%[l],2)")                                                \
  AP_INT4_END(add, "160", "5", "32", "32(%[o],%[l],2)") AP_INT4_END(add, "192", "6", "0", "(%[p])")   \
  AP_INT4_END(add, "224", "7", "32", "32(%[p])") AP_INT4_END(add, "256", "8", "0", "(%[p],%[l])")    \
  AP_INT4_END(add, "288", "9", "32", "32(%[p],%[l])") AP_INT4_END(add, "320", "10", "0", "(%[p],%[l],2)") \
  AP_INT4_END(add, "352", "11", "32", "32(%[p],%[l],2)")
__attribute__((noinline)) void int4_run_end(const int32_t* a, const uint8_t* b, int64_t run, const __m256i* c,
                                            const float* s, bool first, float* o, int64_t ldo) {
  const int64_t l = ldo * static_cast<int64_t>(sizeof(float));
  float* p = o + 3 * ldo;
  if (first) {
    asm volatile(AP_INT4_LOOP AP_INT4_ENDS(AP_INT4_STORE)
                 : [a] "+r"(a), [b] "+r"(b), [n] "+r"(run)
                 : [c] "r"(c), [s] "r"(s), [o] "r"(o), [p] "r"(p), [l] "r"(l)
                 : AP_INT4_CLOBBERS);
  } else {
    asm volatile(AP_INT4_LOOP AP_INT4_ENDS(AP_INT4_ADD)
                 : [a] "+r"(a), [b] "+r"(b), [n] "+r"(run)
                 : [c] "r"(c), [s] "r"(s), [o] "r"(o), [p] "r"(p), [l] "r"(l)
                 : AP_INT4_CLOBBERS);
  }
}
#undef AP_INT4_ROW
#undef AP_INT4_WIDEN
#undef AP_INT4_END
#undef AP_INT4_STORE
#undef AP_INT4_ADD
#undef AP_INT4_ENDS
#undef AP_INT4_LOOP
#undef AP_INT4_CLOBBERS

struct Avx2Int4Quads : QuadLayout<kInt4Strip> {
  static constexpr int64_t MR = kInt4Rows, NR = kInt4Strip;
  static constexpr int64_t kDepthRows = 2 * kGemmDepth, kPanelBytes = kGemmPanelBytes;

  // The tile's sums before its first run: from `init` (ld ldi) or, where init is null, each row r
  // from start[r].
  static inline void first_sums(const int32_t* init, int64_t ldi, const int32_t* start, __m256i* c) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 2; ++j)
        c[2 * r + j] = init != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + r * ldi + 8 * j))
                                       : _mm256_set1_epi32(start[r]);
  }

  // Runs every whole run of kRun quads but the last run of `groups` (>= 1) into c, a and b moved
  // past them; the last run's quads (1 to kRun) are left, and returned.
  static inline int64_t all_but_last_run(const int32_t*& a, const uint8_t*& b, int64_t groups, __m256i* c) {
    for (; groups > kRun; groups -= kRun) {
      int4_run(a, b, kRun, c);
      a += kRun * MR;
      b += kRun * NR * 4;
    }
    return groups;
  }

  static inline void micro(const int32_t* a, const uint8_t* b, int64_t groups, const int32_t* init, int64_t ldi,
                           const int32_t* start, int32_t* dst, int64_t ldd) {
    alignas(32) __m256i c[MR * 2];
    first_sums(init, ldi, start, c);
    groups = all_but_last_run(a, b, groups, c);
    int4_run(a, b, groups, c);
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 2; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * ldd + 8 * j), c[2 * r + j]);
  }

  static void scale_tile(const int32_t* tile, int64_t rows, int64_t cols, const float* scale, bool first, float* out,
                         int64_t ldo) {
    ymm_scale_tile<NR>(tile, rows, cols, scale, first, out, ldo);
  }

  // micro then scale_tile for a whole tile whose block ends here, the last run ending in the
  // float epilogue (int4_run_end).
  static constexpr bool kFusedEnd = true;
  static inline void block_end(const int32_t* a, const uint8_t* b, int64_t groups, const int32_t* init, int64_t ldi,
                               const int32_t* start, const float* scale, bool first, float* out, int64_t ldo) {
    alignas(32) __m256i c[MR * 2];
    first_sums(init, ldi, start, c);
    groups = all_but_last_run(a, b, groups, c);
    int4_run_end(a, b, groups, c, scale, first, out, ldo);
  }
};

}  // namespace

void int8_gemm_avx2(const int32_t* a, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0, int64_t r1,
                    int64_t n0, int64_t n1, int32_t* acc) {
  int8_gemm_tiles<Avx2Pairs>(a, m, k, w, n, r0, r1, n0, n1, acc);
}

void int4_gemm_avx2(const int32_t* a, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                    const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out) {
  int4_gemm_tiles<Avx2Int4Quads>(a, m, k, w, n, block, scale, r0, r1, n0, n1, out);
}

const GemmX kQuadsAvx2X{Avx2Int4Quads::MR, Avx2Int4Quads::NR, Avx2Int4Quads::KG,
                        quads_words<Avx2Int4Quads::MR>, pack_x_quads<Avx2Int4Quads::MR>};

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
