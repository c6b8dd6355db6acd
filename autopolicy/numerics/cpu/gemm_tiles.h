// The register- and cache-blocked GEMM drivers of every SIMD path, included by gemm_avx2.cc
// (AVX2), gemm_vnni.cc (AVX512-VNNI) and gemm_avxvnni.cc (AVX-VNNI) after their target pragmas,
// each with its own Tile (register tile, weight packing, micro-kernel, float epilogue). Everything
// here has internal linkage, so each file's copy is compiled for its own instruction set (nothing
// may be shared between them at link time).
//
// The product is the same as the streaming kernels' (gemv_*.cc), reorganized the BLIS way. K rows
// go Tile::KG at a time, one int32 word per row of x or column of the weights: AVX2 pairs of
// int16 for vpmaddwd (exact for every int8 value, -128 included: nothing saturates), VNNI quads of
// bytes for vpdpbusd (unsigned times signed bytes, four products into a 32-bit lane).
//   - x is packed once per call (GemmX::pack, a run of rows per task in the call's first phase)
//     into panels of Tile::MR rows: [panel][group][row] words; for VNNI then each row's sum over
//     each block of K rows (int8: one block, all of K), for the offset below;
//   - each task (a block of rows times a block of at most kGemmCols columns) packs the weights of
//     one K chunk at a time into strips of Tile::NR columns, [strip][group][column] words (int4
//     nibbles unpacked there; VNNI: each byte offset to unsigned, int8 w xor 0x80 = w + 128, int4
//     v xor 8 = v + 8); the chunk is about Tile::kPanelBytes (fewer K rows for wider blocks), each
//     strip of it stays in cache while the row tiles walk it, and each tile's int32 sums are
//     loaded and stored once a chunk (so deep chunks pay that less often). Wide column blocks
//     matter: packing reads a piece of each weight row, and rows are a page apart at N = 4096, so
//     short pieces leave the hardware prefetchers nothing to stream and packing waits on memory
//     latency;
//   - the micro-kernel (Tile::micro) holds an MR x NR tile of int32 sums in registers: per group
//     it loads a strip's NR columns, broadcasts MR x words and runs one multiply-add per row and
//     vector (AVX2's int4 holds int16 sums, widened into the int32 ones every 8 quads);
//   - the quads' offset (VNNI, AVX2's int4) adds Tile::kOffset8 (128) or kOffset4 (8) times the
//     sum of x over the rows summed: each row's sums start at minus that instead of 0 (int32
//     arithmetic wraps, so the result is exact whenever the true sum fits in int32, as on every
//     path);
//   - int8's later K chunks add to the output; int4 ends each block in the portable path's float
//     operations in its order (out = term for the first block, out + term after,
//     Tile::scale_tile, or Tile::block_end for a whole tile where Tile::kFusedEnd: bit-identical),
//     a block longer than a chunk keeping its int32 sums in a scratch between chunks. int4 blocks
//     must be a multiple of KG K rows (a group never straddles two), or all of K; the FFI sends
//     others to the streaming kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace autopolicy_cpu {
namespace {

// x for the quads GEMMs (kernels.h's kQuadsZmmX, kQuadsYmmX, kQuadsAvx2X): the words it takes,
// and the panels of rows [r0, r1) packed (each row's sums too) from x holding those rows alone.
template <int64_t MR>
int64_t quads_words(int64_t m, int64_t k, int64_t block) {
  const int64_t groups = block >= k ? 1 : (k + block - 1) / block;
  return x_quads(m, k, MR) + groups * ((m + MR - 1) / MR * MR);
}

template <int64_t MR>
void pack_x_quads(const int8_t* x, int64_t m, int64_t k, int64_t block, int64_t r0, int64_t r1, int32_t* a) {
  const int64_t quads = (k + 3) / 4, whole = k / 4, panels = (m + MR - 1) / MR, padded = panels * MR;
  const int64_t groups = block >= k ? 1 : (k + block - 1) / block, span = groups == 1 ? k : block;
  int32_t* sums = a + x_quads(m, k, MR);
  for (int64_t panel = r0 / MR; panel < std::min(panels, (r1 + MR - 1) / MR); ++panel) {
    int32_t* dst = a + panel * quads * MR;
    const int8_t* rows[MR];
    for (int64_t rr = 0; rr < MR; ++rr) rows[rr] = panel * MR + rr < r1 ? x + (panel * MR + rr - r0) * k : nullptr;
    // A quad at a time across the panel's rows: each row read front to back, the words written in
    // order.
    for (int64_t q = 0; q < whole; ++q)
      for (int64_t rr = 0; rr < MR; ++rr) {
        int32_t word = 0;
        if (rows[rr] != nullptr) std::memcpy(&word, rows[rr] + 4 * q, 4);
        dst[q * MR + rr] = word;
      }
    for (int64_t q = whole; q < quads; ++q)  // the last, partial quad (bytes past K are zero)
      for (int64_t rr = 0; rr < MR; ++rr) dst[q * MR + rr] = rows[rr] != nullptr ? quad_of(rows[rr], 4 * q, k) : 0;
    for (int64_t rr = 0; rr < MR; ++rr)
      for (int64_t g = 0; g < groups; ++g) {
        int32_t total = 0;
        if (rows[rr] != nullptr)
          for (int64_t i = g * span; i < std::min(k, (g + 1) * span); ++i) total += rows[rr][i];
        sums[g * padded + panel * MR + rr] = total;
      }
  }
}

// Eight columns' quads (32 bytes, column order) from the four K rows' bytes a .. d (the low 8
// bytes of each), already offset to unsigned.
inline void store_quads8(__m128i a, __m128i b, __m128i c, __m128i d, uint8_t* dst) {
  const __m128i ab = _mm_unpacklo_epi8(a, b), cd = _mm_unpacklo_epi8(c, d);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi16(ab, cd));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm_unpackhi_epi16(ab, cd));
}

inline __m128i load8(const void* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }

// The weights of K quads [q0, q1) and columns [c0, c1) as strips of NR columns ([strip][quad][NR]
// quads of bytes, offset to unsigned; rows past K and columns past c1 are 0x80: x is zero past
// K, and the columns past c1 are never stored).
template <int64_t NR>
void pack_w8(const int8_t* w, int64_t k, int64_t n, int64_t q0, int64_t q1, int64_t c0, int64_t c1, uint8_t* b) {
  static_assert(NR % 8 == 0, "strips are whole groups of 8 columns");
  const int64_t quads = q1 - q0, strips = (c1 - c0 + NR - 1) / NR;
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
  for (int64_t q = q0; q < q1; ++q) {
    const int8_t* rows[4];
    bool whole = true;
    for (int j = 0; j < 4; ++j) {
      rows[j] = 4 * q + j < k ? w + (4 * q + j) * n : nullptr;
      whole = whole && rows[j] != nullptr;
    }
    for (int64_t s = 0; s < strips; ++s) {
      uint8_t* dst = b + (s * quads + (q - q0)) * NR * 4;
      for (int64_t g = 0; g < NR; g += 8) {
        const int64_t c = c0 + s * NR + g;
        if (whole && c + 8 <= c1) {
          store_quads8(_mm_xor_si128(load8(rows[0] + c), flip), _mm_xor_si128(load8(rows[1] + c), flip),
                       _mm_xor_si128(load8(rows[2] + c), flip), _mm_xor_si128(load8(rows[3] + c), flip), dst + 4 * g);
        } else {
          for (int64_t j = 0; j < 8; ++j)
            for (int t = 0; t < 4; ++t) {
              const int64_t col = c + j;
              const int8_t v = col < c1 && rows[t] != nullptr ? rows[t][col] : 0;
              dst[4 * (g + j) + t] = static_cast<uint8_t>(v) ^ 0x80u;
            }
        }
      }
    }
  }
}

// int4: K quads [q0, q1) of the packed kernel (byte row p holds K rows 2p, low nibble, and
// 2p + 1, high) laid out as pack_w8 lays out int8, each nibble offset to unsigned (v xor 8 =
// v + 8, in [0, 15]); byte rows past the stored ones give 0 (x is zero there).
template <int64_t NR>
void pack_w4(const uint8_t* w, int64_t k, int64_t n, int64_t q0, int64_t q1, int64_t c0, int64_t c1, uint8_t* b) {
  static_assert(NR % 8 == 0, "strips are whole groups of 8 columns");
  const int64_t quads = q1 - q0, strips = (c1 - c0 + NR - 1) / NR, byte_rows = (k + 1) / 2;
  const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(0x08);
  for (int64_t q = q0; q < q1; ++q) {
    const uint8_t* e = 2 * q < byte_rows ? w + 2 * q * n : nullptr;
    const uint8_t* f = 2 * q + 1 < byte_rows ? w + (2 * q + 1) * n : nullptr;
    for (int64_t s = 0; s < strips; ++s) {
      uint8_t* dst = b + (s * quads + (q - q0)) * NR * 4;
      for (int64_t g = 0; g < NR; g += 8) {
        const int64_t c = c0 + s * NR + g;
        if (e != nullptr && f != nullptr && c + 8 <= c1) {
          const __m128i ev = load8(e + c), fv = load8(f + c);
          store_quads8(_mm_xor_si128(_mm_and_si128(ev, low), eight),
                       _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(ev, 4), low), eight),
                       _mm_xor_si128(_mm_and_si128(fv, low), eight),
                       _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(fv, 4), low), eight), dst + 4 * g);
        } else {
          for (int64_t j = 0; j < 8; ++j) {
            const int64_t col = c + j;
            const uint8_t ve = col < c1 && e != nullptr ? e[col] : 0x88, vf = col < c1 && f != nullptr ? f[col] : 0x88;
            uint8_t* quad = dst + 4 * (g + j);
            quad[0] = (ve & 0x0F) ^ 0x08;
            quad[1] = (ve >> 4) ^ 0x08;
            quad[2] = (vf & 0x0F) ^ 0x08;
            quad[3] = (vf >> 4) ^ 0x08;
          }
        }
      }
    }
  }
}

// The layout of the vpdpbusd GEMMs (AVX512-VNNI, AVX-VNNI): quads of K rows, each weight byte
// offset to unsigned, NR columns a strip.
template <int64_t NR>
struct QuadLayout {
  static constexpr int64_t KG = 4, kDepthRows = kVnniGemmDepth, kPanelBytes = kVnniPanelBytes;
  static constexpr uint32_t kOffset8 = 128, kOffset4 = 8;
  static constexpr bool kPrefetchSums = false;
  static constexpr bool kFusedEnd = false;  // int4 blocks end in micro, then scale_tile

  static void pack8(const int8_t* w, int64_t k, int64_t n, int64_t g0, int64_t g1, int64_t c0, int64_t c1, uint8_t* b) {
    pack_w8<NR>(w, k, n, g0, g1, c0, c1, b);
  }
  static void pack4(const uint8_t* w, int64_t k, int64_t n, int64_t g0, int64_t g1, int64_t c0, int64_t c1, uint8_t* b) {
    pack_w4<NR>(w, k, n, g0, g1, c0, c1, b);
  }
};

// out = term (first block) or out + term, term = float(sum) * scale, eight columns at a time and
// the last ones one by one: the portable path's float operations in its order. tile: rows x cols
// of int32 sums (ld NR).
template <int64_t NR>
void ymm_scale_tile(const int32_t* tile, int64_t rows, int64_t cols, const float* scale, bool first, float* out,
                    int64_t ldo) {
  int64_t j = 0;
  for (; j + 8 <= cols; j += 8) {
    const __m256 s = _mm256_loadu_ps(scale + j);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 term = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + r * NR + j))), s);
      float* y = out + r * ldo + j;
      _mm256_storeu_ps(y, first ? term : _mm256_add_ps(_mm256_loadu_ps(y), term));
    }
  }
  for (; j < cols; ++j)
    for (int64_t r = 0; r < rows; ++r) {
      const float term = static_cast<float>(tile[r * NR + j]) * scale[j];
      float* y = out + r * ldo + j;
      *y = first ? term : *y + term;
    }
}

// A 4 x 24 tile of int32 sums in 12 YMM registers (AVX2 pairs, AVX-VNNI quads): per group of K
// rows it loads 3 weight vectors, broadcasts 4 x words and adds 12 products with Op::add(sums,
// weights, x).
template <class Op>
struct Ymm4x24 {
  static constexpr int64_t MR = 4, NR = 24;

  // One tile over `groups` K groups: starts from `init` (ld ldi) or, where init is null, each
  // row r from start[r]; ends in dst (ld ldd; may be init). a: [group][4] words, b: [group][24]
  // words.
  __attribute__((always_inline)) static inline void micro(const int32_t* a, const uint8_t* b, int64_t groups,
                                                          const int32_t* init, int64_t ldi, const int32_t* start,
                                                          int32_t* dst, int64_t ldd) {
    __m256i c[MR][3];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 3; ++j)
        c[r][j] = init != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + r * ldi + 8 * j))
                                  : _mm256_set1_epi32(start[r]);
    for (int64_t p = 0; p < groups; ++p) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
      const __m256i w2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64));
      for (int r = 0; r < MR; ++r) {
        const __m256i x = _mm256_set1_epi32(a[r]);
        c[r][0] = Op::add(c[r][0], w0, x);
        c[r][1] = Op::add(c[r][1], w1, x);
        c[r][2] = Op::add(c[r][2], w2, x);
      }
      a += MR;
      b += NR * 4;
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 3; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * ldd + 8 * j), c[r][j]);
  }

  static void scale_tile(const int32_t* tile, int64_t rows, int64_t cols, const float* scale, bool first, float* out,
                         int64_t ldo) {
    ymm_scale_tile<NR>(tile, rows, cols, scale, first, out, ldo);
  }
};

// The K groups of one packed chunk for `width` columns: the chunk (groups x width words) near
// Tile::kPanelBytes (and at most Tile::kDepthRows deep); wide column blocks read long pieces of
// each weight row.
template <class Tile>
int64_t chunk_groups(int64_t width) {
  const int64_t padded = (width + Tile::NR - 1) / Tile::NR * Tile::NR;
  return std::max<int64_t>(8, std::min<int64_t>(Tile::kDepthRows / Tile::KG, Tile::kPanelBytes / 4 / padded));
}

// Each row's sums start at -offset * sum (wrapping int32 arithmetic).
inline int32_t offset_start(uint32_t offset, int32_t sum) {
  return static_cast<int32_t>(0u - offset * static_cast<uint32_t>(sum));
}

// Rows [0, rows) and columns [0, cols) copied between a tile (NR int32 a row) and a strided
// buffer; the tile's other cells are zeroed when it is filled (a partial tile at an edge).
template <int64_t NR>
inline void fill_tile(int32_t* tile, const int32_t* src, int64_t ld, int64_t rows, int64_t cols, int64_t mr) {
  std::memset(tile, 0, static_cast<size_t>(mr * NR) * sizeof(int32_t));
  for (int64_t rr = 0; rr < rows; ++rr) std::memcpy(tile + rr * NR, src + rr * ld, cols * sizeof(int32_t));
}

template <int64_t NR>
inline void spill_tile(int32_t* dst, int64_t ld, const int32_t* tile, int64_t rows, int64_t cols) {
  for (int64_t rr = 0; rr < rows; ++rr) std::memcpy(dst + rr * ld, tile + rr * NR, cols * sizeof(int32_t));
}

// The drivers' loop nest: chunks of `depth` K groups (each packed once by pack(g0, g1)), strips
// of NR columns of [n0, n1), tiles of MR rows of [r0, min(r1, m)); body(g0, g1, strip, c, cols,
// r, rows) runs one tile of one chunk.
template <class Tile, class Pack, class Body>
inline void over_tiles(int64_t groups, int64_t depth, int64_t m, int64_t r0, int64_t r1, int64_t n0, int64_t n1,
                       const uint8_t* panel, Pack pack, Body body) {
  constexpr int64_t MR = Tile::MR, NR = Tile::NR;
  for (int64_t g0 = 0; g0 < groups; g0 += depth) {
    const int64_t g1 = std::min(groups, g0 + depth), chunk = g1 - g0;
    pack(g0, g1);
    for (int64_t c = n0; c < n1; c += NR) {
      const uint8_t* strip = panel + ((c - n0) / NR) * chunk * NR * 4;
      const int64_t cols = std::min(NR, n1 - c);
      for (int64_t r = r0; r < r1; r += MR) body(g0, g1, strip, c, cols, r, std::min(MR, std::min(m, r1) - r));
    }
  }
}

template <class Tile>
void int8_gemm_tiles(const int32_t* a, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0, int64_t r1,
                     int64_t n0, int64_t n1, int32_t* acc) {
  constexpr int64_t MR = Tile::MR, NR = Tile::NR;
  static thread_local std::vector<uint8_t> panel;
  const int64_t groups = (k + Tile::KG - 1) / Tile::KG, depth = chunk_groups<Tile>(n1 - n0);
  const int32_t* sums = a + (m + MR - 1) / MR * MR * groups;  // read only where Tile::kOffset8
  const size_t need = static_cast<size_t>(std::min(depth, groups) * ((n1 - n0 + NR - 1) / NR) * NR * 4);
  if (panel.size() < need) panel.resize(need);
  uint8_t* b = panel.data();
  alignas(64) int32_t tile[MR * NR];
  int32_t start[MR] = {};
  auto pack = [&](int64_t g0, int64_t g1) { Tile::pack8(w, k, n, g0, g1, n0, n1, b); };
  over_tiles<Tile>(groups, depth, m, r0, r1, n0, n1, b, pack, [&](int64_t g0, int64_t g1, const uint8_t* strip,
                                                                   int64_t c, int64_t cols, int64_t r, int64_t rows) {
    const int64_t chunk = g1 - g0;
    const bool whole = rows == MR && cols == NR;
    const int32_t* ap = a + (r / MR) * groups * MR + g0 * MR;
    int32_t* out = acc + r * n + c;
    int32_t* dst = whole ? out : tile;
    const int64_t ldd = whole ? n : NR;
    if (Tile::kPrefetchSums && g0 > 0 && r + MR < r1) {  // the next tile's sums, from L3 while this one runs
      for (int64_t rr = 0; rr < MR; ++rr) {
        const char* next = reinterpret_cast<const char*>(out + (MR + rr) * n);
        _mm_prefetch(next, _MM_HINT_T0);
        _mm_prefetch(next + 64, _MM_HINT_T0);
        _mm_prefetch(next + 4 * NR - 1, _MM_HINT_T0);
      }
    }
    if (g0 == 0) {
      if (Tile::kOffset8 != 0)
        for (int64_t rr = 0; rr < MR; ++rr) start[rr] = offset_start(Tile::kOffset8, sums[r + rr]);
      Tile::micro(ap, strip, chunk, nullptr, 0, start, dst, ldd);
    } else if (whole) {
      Tile::micro(ap, strip, chunk, out, n, start, out, n);  // start unread (init given)
    } else {
      fill_tile<NR>(tile, out, n, rows, cols, MR);
      Tile::micro(ap, strip, chunk, tile, NR, start, tile, NR);
    }
    if (!whole) spill_tile<NR>(out, n, tile, rows, cols);
  });
}

// int4: a chunk holds whole blocks where blocks are short (each tile then runs its blocks one
// after the other, each ending in the scale epilogue), or part of one long block (its int32 sums
// wait in a scratch between chunks).
template <class Tile>
void int4_gemm_tiles(const int32_t* a, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                     const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out) {
  constexpr int64_t MR = Tile::MR, NR = Tile::NR;
  static thread_local std::vector<uint8_t> panel;
  static thread_local std::vector<int32_t> scratch_buffer;
  const int64_t groups = (k + Tile::KG - 1) / Tile::KG, width = n1 - n0, padded = (m + MR - 1) / MR * MR;
  const int64_t blocks = block >= k ? 1 : (k + block - 1) / block;
  const int64_t block_groups = blocks == 1 ? groups : block / Tile::KG;
  const int32_t* sums = a + padded * groups;  // read only where Tile::kOffset4
  int64_t depth = chunk_groups<Tile>(width);
  if (block_groups <= depth) depth = depth / block_groups * block_groups;
  const size_t need = static_cast<size_t>(std::min(depth, groups) * ((width + NR - 1) / NR) * NR * 4);
  if (panel.size() < need) panel.resize(need);
  uint8_t* b = panel.data();
  int32_t* scratch = nullptr;
  if (block_groups > depth) {
    const size_t cells = static_cast<size_t>((r1 - r0) * width);
    if (scratch_buffer.size() < cells) scratch_buffer.resize(cells);
    scratch = scratch_buffer.data();
  }
  alignas(64) int32_t tile[MR * NR];
  int32_t start[MR] = {};
  auto pack = [&](int64_t g0, int64_t g1) { Tile::pack4(w, k, n, g0, g1, n0, n1, b); };
  over_tiles<Tile>(groups, depth, m, r0, r1, n0, n1, b, pack, [&](int64_t g0, int64_t g1, const uint8_t* strip,
                                                                   int64_t c, int64_t cols, int64_t r, int64_t rows) {
    const int32_t* ap = a + (r / MR) * groups * MR;
    int32_t* keep = scratch == nullptr ? nullptr : scratch + (r - r0) * width + (c - n0);
    for (int64_t q = g0; q < g1;) {
      const int64_t blk = q / block_groups, b0 = blk * block_groups, b1 = std::min(groups, b0 + block_groups);
      const int64_t qe = std::min(g1, b1);
      const int32_t* aq = ap + q * MR;
      const uint8_t* bq = strip + (q - g0) * NR * 4;
      if (q == b0 && Tile::kOffset4 != 0)
        for (int64_t rr = 0; rr < MR; ++rr) start[rr] = offset_start(Tile::kOffset4, sums[blk * padded + r + rr]);
      if constexpr (Tile::kFusedEnd) {
        if (qe == b1 && rows == MR && cols == NR) {  // the block ends here, in its float epilogue
          Tile::block_end(aq, bq, qe - q, q == b0 ? nullptr : keep, width, start, scale + blk * n + c, blk == 0,
                          out + r * n + c, n);
          q = qe;
          continue;
        }
      }
      if (q == b0) {
        Tile::micro(aq, bq, qe - q, nullptr, 0, start, tile, NR);
      } else if (rows == MR && cols == NR) {
        Tile::micro(aq, bq, qe - q, keep, width, start, tile, NR);  // start unread (init given)
      } else {  // the scratch holds only this task's rows and columns
        fill_tile<NR>(tile, keep, width, rows, cols, MR);
        Tile::micro(aq, bq, qe - q, tile, NR, start, tile, NR);
      }
      if (qe == b1) {
        Tile::scale_tile(tile, rows, cols, scale + blk * n + c, blk == 0, out + r * n + c, n);
      } else {
        spill_tile<NR>(keep, width, tile, rows, cols);
      }
      q = qe;
    }
  });
}

}  // namespace
}  // namespace autopolicy_cpu
