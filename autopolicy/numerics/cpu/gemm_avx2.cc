// The AVX2 GEMM for many rows of x (M >= gemm_min_rows()): register-blocked, cache-blocked.
// The int8 product uses it from 16 rows; the int4 one only when forced (set_gemm_min_rows): the
// int4 streaming kernel (gemv_avx2.cc, vpmaddubsw on nibbles + 8) was measured faster at every M.
//
// The product is the same as the streaming kernels' (gemv_avx2.cc), reorganized the BLIS way:
//   - x is packed once per call (pack_x_pairs, before the work is split) into panels of kGemmRows
//     rows, each K pair (x[2p], x[2p+1]) as one int32 word holding two int16: [panel][pair][row];
//   - each task (a block of rows times a block of at most kGemmCols columns) packs the weights of
//     one K chunk at a time into strips of kGemmStrip columns, each K pair of a column as two int16
//     in one int32 word: [strip][pair][column], int4 nibbles unpacked to int16 there; the chunk
//     (about kGemmPanelBytes: fewer K rows for wider blocks) stays in L2 and the strip the
//     micro-kernel walks (at most 12 KB) in L1. Wide column blocks matter: packing reads a piece
//     of each weight row, and rows are a page apart at N = 4096, so short pieces leave the
//     hardware prefetchers nothing to stream and packing waits on memory latency;
//   - the micro-kernel holds a 4 x 24 tile of int32 sums in 12 YMM registers: per K pair it loads
//     3 weight vectors and broadcasts 4 x words, and runs 12 vpmaddwd (exact for every int8 value,
//     -128 included: unlike vpmaddubsw nothing saturates) and 12 vpaddd;
//   - int8: the int32 sums go back to the output between K chunks; int4: a block's sums are kept
//     in int32 across its chunks (a scratch), and when the block ends they are converted to float,
//     times the block's scales, and added into the output in block order (out = term for the first
//     block, out + term after: the portable path's float operations in its order, so bit-identical).
// Everything before the target pragma is compiled for the baseline ISA.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace autopolicy_cpu {

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
      for (int64_t p = 0; p < pairs; ++p) {
        const int32_t lo = row[2 * p], hi = 2 * p + 1 < k ? row[2 * p + 1] : 0;
        dst[p * kGemmRows + rr] = static_cast<int32_t>((static_cast<uint32_t>(lo) & 0xFFFFu) |
                                                       (static_cast<uint32_t>(hi) << 16));
      }
    }
  }
}

namespace {
int64_t pairs_words(int64_t m, int64_t k, int64_t) { return (m + kGemmRows - 1) / kGemmRows * kGemmRows * ((k + 1) / 2); }
void pack_pairs(const int8_t* x, int64_t m, int64_t k, int64_t, int32_t* a) { pack_x_pairs(x, m, k, a); }
}  // namespace

const GemmX kPairsX{kGemmRows, kGemmStrip, 2, pairs_words, pack_pairs};

}  // namespace autopolicy_cpu

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

namespace autopolicy_cpu {
namespace {

constexpr int64_t MR = kGemmRows, NR = kGemmStrip;
static_assert(MR == 4 && NR == 24, "the micro-kernel is written for 4 x 24 tiles");

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

// One 4 x 24 tile over `pairs` K pairs: starts from `init` (ld ldi; null: zero), ends in dst
// (ld NR). a: [pair][4] words, b: [pair][24] words.
__attribute__((always_inline)) inline void micro(const int32_t* a, const int32_t* b, int64_t pairs,
                                                 const int32_t* init, int64_t ldi, int32_t* dst) {
  __m256i c00, c01, c02, c10, c11, c12, c20, c21, c22, c30, c31, c32;
  if (init != nullptr) {
#define AP_LOAD(r) \
  c##r##0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + r * ldi)); \
  c##r##1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + r * ldi + 8)); \
  c##r##2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + r * ldi + 16));
    AP_LOAD(0) AP_LOAD(1) AP_LOAD(2) AP_LOAD(3)
#undef AP_LOAD
  } else {
    c00 = c01 = c02 = c10 = c11 = c12 = c20 = c21 = c22 = c30 = c31 = c32 = _mm256_setzero_si256();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8));
    const __m256i b2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
#define AP_ROW(r)                                                  \
  {                                                                \
    const __m256i x = _mm256_set1_epi32(a[r]);                     \
    c##r##0 = _mm256_add_epi32(c##r##0, _mm256_madd_epi16(b0, x)); \
    c##r##1 = _mm256_add_epi32(c##r##1, _mm256_madd_epi16(b1, x)); \
    c##r##2 = _mm256_add_epi32(c##r##2, _mm256_madd_epi16(b2, x)); \
  }
    AP_ROW(0) AP_ROW(1) AP_ROW(2) AP_ROW(3)
#undef AP_ROW
    a += MR;
    b += NR;
  }
#define AP_STORE(r) \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * NR), c##r##0); \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * NR + 8), c##r##1); \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * NR + 16), c##r##2);
  AP_STORE(0) AP_STORE(1) AP_STORE(2) AP_STORE(3)
#undef AP_STORE
}

// A tile's int32 sums from src (ld lds) into a zero-padded 4 x 24 tile (the rows and columns a
// tile at the edge lacks).
void load_partial(const int32_t* src, int64_t lds, int64_t rows, int64_t cols, int32_t* tile) {
  std::memset(tile, 0, MR * NR * sizeof(int32_t));
  for (int64_t r = 0; r < rows; ++r) std::memcpy(tile + r * NR, src + r * lds, cols * sizeof(int32_t));
}

void store_tile(const int32_t* tile, int64_t rows, int64_t cols, int32_t* dst, int64_t ldd) {
  if (rows == MR && cols == NR) {
    for (int64_t r = 0; r < MR; ++r)
      for (int64_t j = 0; j < NR; j += 8)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * ldd + j),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + r * NR + j)));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ldd, tile + r * NR, cols * sizeof(int32_t));
}

// out = term (first block) or out + term, term = float(sum) * scale: the portable path's order.
void scale_tile(const int32_t* tile, int64_t rows, int64_t cols, const float* scale, bool first, float* out,
                int64_t ldo) {
  if (cols == NR) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < NR; j += 8) {
        const __m256 term = _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + r * NR + j))),
            _mm256_loadu_ps(scale + j));
        float* y = out + r * ldo + j;
        _mm256_storeu_ps(y, first ? term : _mm256_add_ps(_mm256_loadu_ps(y), term));
      }
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      const float term = static_cast<float>(tile[r * NR + j]) * scale[j];
      float* y = out + r * ldo + j;
      *y = first ? term : *y + term;
    }
}

thread_local std::vector<int32_t> t_panel, t_scratch;

// The K pairs of one packed chunk for `width` columns: the chunk (pairs x width int32 words) near
// kGemmPanelBytes, so it stays in L2, and wide column blocks read long pieces of each weight row.
int64_t chunk_pairs(int64_t width) {
  const int64_t padded = (width + NR - 1) / NR * NR;
  return std::max<int64_t>(8, std::min<int64_t>(kGemmDepth / 2, kGemmPanelBytes / 4 / padded));
}

int32_t* panel_buffer(int64_t pairs, int64_t width) {
  const size_t need = static_cast<size_t>(pairs * ((width + NR - 1) / NR) * NR);
  if (t_panel.size() < need) t_panel.resize(need);
  return t_panel.data();
}

}  // namespace

void int8_gemm_avx2(const int32_t* a, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0, int64_t r1,
                    int64_t n0, int64_t n1, int32_t* acc) {
  const int64_t pairs = (k + 1) / 2, depth = chunk_pairs(n1 - n0);
  int32_t* b = panel_buffer(std::min(depth, pairs), n1 - n0);
  alignas(32) int32_t tile[MR * NR];
  for (int64_t p0 = 0; p0 < pairs; p0 += depth) {
    const int64_t p1 = std::min(pairs, p0 + depth), chunk = p1 - p0;
    pack_int8(w, k, n, p0, p1, n0, n1, b);
    for (int64_t c = n0; c < n1; c += NR) {
      const int32_t* strip = b + ((c - n0) / NR) * chunk * NR;
      const int64_t cols = std::min(NR, n1 - c);
      for (int64_t r = r0; r < r1; r += MR) {
        const int64_t rows = std::min(MR, std::min(m, r1) - r);
        const int32_t* ap = a + (r / MR) * pairs * MR + p0 * MR;
        int32_t* out = acc + r * n + c;
        if (p0 > 0 && r + MR < r1) {  // the next tile's sums, from L3 while this one runs
          for (int64_t rr = 0; rr < MR; ++rr) {
            const char* next = reinterpret_cast<const char*>(out + (MR + rr) * n);
            _mm_prefetch(next, _MM_HINT_T0);
            _mm_prefetch(next + 64, _MM_HINT_T0);
            _mm_prefetch(next + 4 * NR - 1, _MM_HINT_T0);
          }
        }
        if (p0 == 0) {
          micro(ap, strip, chunk, nullptr, 0, tile);
        } else if (rows == MR && cols == NR) {
          micro(ap, strip, chunk, out, n, tile);
        } else {
          load_partial(out, n, rows, cols, tile);
          micro(ap, strip, chunk, tile, NR, tile);
        }
        store_tile(tile, rows, cols, out, n);
      }
    }
  }
}

// int4: a chunk holds whole blocks where blocks are short (each tile then runs its blocks one
// after the other, each ending in the scale epilogue), or part of one long block (its int32 sums
// wait in a scratch between chunks).
void int4_gemm_avx2(const int32_t* a, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                    const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out) {
  const int64_t pairs = (k + 1) / 2, width = n1 - n0;
  const int64_t groups = (k + block - 1) / block;
  const int64_t block_pairs = groups == 1 ? pairs : block / 2;  // blocks are even or one
  int64_t depth = chunk_pairs(width);
  if (block_pairs <= depth) depth = depth / block_pairs * block_pairs;
  int32_t* b = panel_buffer(std::min(depth, pairs), width);
  int32_t* scratch = nullptr;
  if (block_pairs > depth) {
    const size_t need = static_cast<size_t>((r1 - r0) * width);
    if (t_scratch.size() < need) t_scratch.resize(need);
    scratch = t_scratch.data();
  }
  alignas(32) int32_t tile[MR * NR];
  for (int64_t p0 = 0; p0 < pairs; p0 += depth) {
    const int64_t p1 = std::min(pairs, p0 + depth), chunk = p1 - p0;
    pack_int4(w, n, p0, p1, n0, n1, b);
    for (int64_t c = n0; c < n1; c += NR) {
      const int32_t* strip = b + ((c - n0) / NR) * chunk * NR;
      const int64_t cols = std::min(NR, n1 - c);
      for (int64_t r = r0; r < r1; r += MR) {
        const int64_t rows = std::min(MR, std::min(m, r1) - r);
        const int32_t* ap = a + (r / MR) * pairs * MR;
        int32_t* keep = scratch == nullptr ? nullptr : scratch + (r - r0) * width + (c - n0);
        for (int64_t q = p0; q < p1;) {
          const int64_t g = q / block_pairs, g0 = g * block_pairs, g1 = std::min(pairs, g0 + block_pairs);
          const int64_t q1 = std::min(p1, g1);
          const int32_t* aq = ap + q * MR;
          const int32_t* bq = strip + (q - p0) * NR;
          if (q == g0) {
            micro(aq, bq, q1 - q, nullptr, 0, tile);
          } else if (rows == MR && cols == NR) {
            micro(aq, bq, q1 - q, keep, width, tile);
          } else {
            load_partial(keep, width, rows, cols, tile);
            micro(aq, bq, q1 - q, tile, NR, tile);
          }
          if (q1 == g1) {
            scale_tile(tile, rows, cols, scale + g * n + c, g == 0, out + r * n + c, n);
          } else {
            store_tile(tile, rows, cols, keep, width);
          }
          q = q1;
        }
      }
    }
  }
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
