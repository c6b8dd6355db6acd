// The AVX2 GEMMs for many rows of x (M >= gemm_min_rows()), on gemm_tiles.h's drivers: the int8
// product uses them from 16 rows; the int4 one only when forced (set_gemm_min_rows): the int4
// streaming kernel (gemv_avx2.cc, vpmaddubsw on nibbles + 8) was measured faster at every M.
// K rows go in pairs: x packed as one int32 word of two int16 per pair (pack_x_pairs), the
// weights as two int16 per pair of a column (int4 nibbles unpacked to int16); the micro-kernel
// holds a 4 x 24 tile of int32 sums in 12 YMM registers and per K pair loads 3 weight vectors,
// broadcasts 4 x words, and runs 12 vpmaddwd (exact for every int8 value, -128 included: unlike
// vpmaddubsw nothing saturates) and 12 vpaddd.
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

// int4: byte row p holds rows 2p (low nibble) and 2p + 1 (high), already the pair a word needs.
void pack_int4(const uint8_t* w, int64_t n, int64_t p0, int64_t p1, int64_t c0, int64_t c1, int32_t* b) {
  const int64_t pairs = p1 - p0, width = c1 - c0;
  const int64_t strips = (width + NR - 1) / NR;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* row = w + p * n;
    for (int64_t s = 0; s < strips; ++s) {
      int32_t* dst = b + (s * pairs + (p - p0)) * NR;
      for (int64_t g = 0; g < NR; g += 8) {
        const int64_t c = c0 + s * NR + g;
        if (c + 8 <= c1) {
          // byte v in a 32-bit lane; v | v << 12 puts the high nibble in bits 16-19; each 16-bit
          // half then sign-extends its low 4 bits.
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
          const __m256i t = _mm256_or_si256(v, _mm256_slli_epi32(v, 12));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + g), _mm256_srai_epi16(_mm256_slli_epi16(t, 12), 12));
        } else {
          for (int64_t j = 0; j < 8; ++j) {
            const int64_t col = c + j;
            const uint8_t v = col < c1 ? row[col] : 0;
            const int32_t lo = static_cast<int8_t>(static_cast<uint8_t>(v << 4)) >> 4, hi = static_cast<int8_t>(v) >> 4;
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
  static void pack4(const uint8_t* w, int64_t, int64_t n, int64_t g0, int64_t g1, int64_t c0, int64_t c1, uint8_t* b) {
    pack_int4(w, n, g0, g1, c0, c1, reinterpret_cast<int32_t*>(b));
  }
};
static_assert(Avx2Pairs::MR == kGemmRows && Avx2Pairs::NR == kGemmStrip, "kernels.h's tile");

}  // namespace

void int8_gemm_avx2(const int32_t* a, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0, int64_t r1,
                    int64_t n0, int64_t n1, int32_t* acc) {
  int8_gemm_tiles<Avx2Pairs>(a, m, k, w, n, r0, r1, n0, n1, acc);
}

void int4_gemm_avx2(const int32_t* a, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                    const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out) {
  int4_gemm_tiles<Avx2Pairs>(a, m, k, w, n, block, scale, r0, r1, n0, n1, out);
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
