// The AVX512-VNNI GEMMs for many rows of x (M >= gemm_min_rows()): the AVX2 GEMM's blocking
// (gemm_avx2.cc) around vpdpbusd, which multiplies 64 unsigned bytes by 64 signed bytes and adds
// each four products into a 32-bit lane: 64 products an instruction, where the AVX2 GEMM's
// vpmaddwd and vpaddd make 16.
//   - x is packed once per call (pack_x_quads, before the work is split) into panels of
//     kVnniGemmRows rows, each quad of K rows (x[4q] .. x[4q + 3]) one int32 word: [panel][quad][row],
//     then each row's sum over each block of K rows (int8: one block, all of K);
//   - each task (a block of rows times a block of columns) packs the weights of one K chunk at a
//     time into strips of kVnniGemmStrip columns, each column's quad as four unsigned bytes
//     (int8: w xor 0x80 = w + 128; int4: each nibble xor 8 = v + 8): [strip][quad][column]; the
//     chunk (about kVnniPanelBytes) stays in L2 and the strip the micro-kernel walks in L1;
//   - the micro-kernel holds an 8 x 48 tile of int32 sums in 24 ZMM registers: per quad it loads
//     3 weight vectors, broadcasts 8 x words (the signed operand: every int8 activation, -128
//     included, is taken as it is), and runs 24 vpdpbusd;
//   - the offset adds 128 (int8) or 8 (int4) times the sum of x over the rows summed: each row's
//     sums start at minus that instead of 0 (int32 arithmetic wraps, so the result is exact
//     whenever the true sum fits in int32, as on every path). int8's later K chunks add to the
//     output; int4 ends each block in the portable path's float operations in its order (out =
//     term for the first block, out + term after: bit-identical), a block longer than a chunk
//     keeping its int32 sums in a scratch between chunks. int4 blocks must be a multiple of 4 K
//     rows (a quad never straddles two), or all of K; the FFI sends others to the streams.
// Everything before the target pragma is compiled for the baseline ISA.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace autopolicy_cpu {
namespace {

constexpr int64_t MR = kVnniGemmRows, NR = kVnniGemmStrip;

int64_t quads_words(int64_t m, int64_t k, int64_t block) {
  const int64_t groups = block >= k ? 1 : (k + block - 1) / block;
  return x_quads(m, k) + groups * ((m + MR - 1) / MR * MR);
}

void pack_x_quads(const int8_t* x, int64_t m, int64_t k, int64_t block, int32_t* a) {
  const int64_t quads = (k + 3) / 4, panels = (m + MR - 1) / MR, padded = panels * MR;
  const int64_t groups = block >= k ? 1 : (k + block - 1) / block, span = groups == 1 ? k : block;
  int32_t* sums = a + x_quads(m, k);
  for (int64_t panel = 0; panel < panels; ++panel) {
    int32_t* dst = a + panel * quads * MR;
    for (int64_t rr = 0; rr < MR; ++rr) {
      const int64_t r = panel * MR + rr;
      if (r >= m) {
        for (int64_t q = 0; q < quads; ++q) dst[q * MR + rr] = 0;
        for (int64_t g = 0; g < groups; ++g) sums[g * padded + r] = 0;
        continue;
      }
      const int8_t* row = x + r * k;
      for (int64_t q = 0; q < quads; ++q) dst[q * MR + rr] = quad_of(row, 4 * q, k);
      for (int64_t g = 0; g < groups; ++g) {
        int32_t total = 0;
        for (int64_t i = g * span; i < std::min(k, (g + 1) * span); ++i) total += row[i];
        sums[g * padded + r] = total;
      }
    }
  }
}

}  // namespace

const GemmX kQuadsX{MR, NR, 4, quads_words, pack_x_quads};

}  // namespace autopolicy_cpu

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
#include <immintrin.h>

namespace autopolicy_cpu {
namespace {

static_assert(MR == 8 && NR == 48, "the micro-kernel is written for 8 x 48 tiles");
constexpr int64_t kStripBytes = NR * 4;  // one quad of a strip

// The weights of K quads [q0, q1) and columns [c0, c1) as strips of NR columns ([strip][quad][NR]
// quads of bytes, offset to unsigned; rows past K and columns past c1 are 0x80: x is zero past
// K, and the columns past c1 are never stored).
void pack_w(const int8_t* w, int64_t k, int64_t n, int64_t q0, int64_t q1, int64_t c0, int64_t c1, uint8_t* b) {
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
      uint8_t* dst = b + (s * quads + (q - q0)) * kStripBytes;
      for (int64_t g = 0; g < NR; g += 16) {
        const int64_t c = c0 + s * NR + g;
        if (whole && c + 16 <= c1) {
          // Four rows' 16 bytes interleaved into 16 quads in column order: bytes, then pairs.
          const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[0] + c));
          const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[1] + c));
          const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2] + c));
          const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[3] + c));
          const __m128i lo01 = _mm_unpacklo_epi8(r0, r1), hi01 = _mm_unpackhi_epi8(r0, r1);
          const __m128i lo23 = _mm_unpacklo_epi8(r2, r3), hi23 = _mm_unpackhi_epi8(r2, r3);
          __m128i* out = reinterpret_cast<__m128i*>(dst + 4 * g);
          _mm_storeu_si128(out, _mm_xor_si128(_mm_unpacklo_epi16(lo01, lo23), flip));
          _mm_storeu_si128(out + 1, _mm_xor_si128(_mm_unpackhi_epi16(lo01, lo23), flip));
          _mm_storeu_si128(out + 2, _mm_xor_si128(_mm_unpacklo_epi16(hi01, hi23), flip));
          _mm_storeu_si128(out + 3, _mm_xor_si128(_mm_unpackhi_epi16(hi01, hi23), flip));
        } else {
          for (int64_t j = 0; j < 16; ++j)
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
// 2p + 1, high) as pack_w lays out int8, each nibble offset to unsigned (v xor 8 = v + 8, in
// [0, 15]); byte rows past the stored ones are 8 (x is zero there).
void pack_w4(const uint8_t* w, int64_t k, int64_t n, int64_t q0, int64_t q1, int64_t c0, int64_t c1, uint8_t* b) {
  const int64_t quads = q1 - q0, strips = (c1 - c0 + NR - 1) / NR, byte_rows = (k + 1) / 2;
  const __m128i low = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(0x08);
  for (int64_t q = q0; q < q1; ++q) {
    const uint8_t* e = 2 * q < byte_rows ? w + 2 * q * n : nullptr;
    const uint8_t* f = 2 * q + 1 < byte_rows ? w + (2 * q + 1) * n : nullptr;
    for (int64_t s = 0; s < strips; ++s) {
      uint8_t* dst = b + (s * quads + (q - q0)) * kStripBytes;
      for (int64_t g = 0; g < NR; g += 16) {
        const int64_t c = c0 + s * NR + g;
        if (e != nullptr && f != nullptr && c + 16 <= c1) {
          const __m128i ev = _mm_loadu_si128(reinterpret_cast<const __m128i*>(e + c));
          const __m128i fv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(f + c));
          const __m128i e_lo = _mm_xor_si128(_mm_and_si128(ev, low), eight);
          const __m128i e_hi = _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(ev, 4), low), eight);
          const __m128i f_lo = _mm_xor_si128(_mm_and_si128(fv, low), eight);
          const __m128i f_hi = _mm_xor_si128(_mm_and_si128(_mm_srli_epi16(fv, 4), low), eight);
          const __m128i lo01 = _mm_unpacklo_epi8(e_lo, e_hi), hi01 = _mm_unpackhi_epi8(e_lo, e_hi);
          const __m128i lo23 = _mm_unpacklo_epi8(f_lo, f_hi), hi23 = _mm_unpackhi_epi8(f_lo, f_hi);
          __m128i* out = reinterpret_cast<__m128i*>(dst + 4 * g);
          _mm_storeu_si128(out, _mm_unpacklo_epi16(lo01, lo23));
          _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(lo01, lo23));
          _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(hi01, hi23));
          _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(hi01, hi23));
        } else {
          for (int64_t j = 0; j < 16; ++j) {
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

// One 8 x 48 tile over `quads` K quads: starts from `init` (ld ldi) or, where init is null, each
// row r from start[r]; ends in dst (ld ldd; may be init). a: [quad][8] words, b: [quad][48] quads.
__attribute__((always_inline)) inline void micro(const int32_t* a, const uint8_t* b, int64_t quads,
                                                 const int32_t* init, int64_t ldi, const int32_t* start,
                                                 int32_t* dst, int64_t ldd) {
  __m512i c00, c01, c02, c10, c11, c12, c20, c21, c22, c30, c31, c32;
  __m512i c40, c41, c42, c50, c51, c52, c60, c61, c62, c70, c71, c72;
#define AP_INIT(r)                                                \
  if (init != nullptr) {                                          \
    c##r##0 = _mm512_loadu_si512(init + r * ldi);                 \
    c##r##1 = _mm512_loadu_si512(init + r * ldi + 16);            \
    c##r##2 = _mm512_loadu_si512(init + r * ldi + 32);            \
  } else {                                                        \
    c##r##0 = c##r##1 = c##r##2 = _mm512_set1_epi32(start[r]);    \
  }
  AP_INIT(0) AP_INIT(1) AP_INIT(2) AP_INIT(3) AP_INIT(4) AP_INIT(5) AP_INIT(6) AP_INIT(7)
#undef AP_INIT
  for (int64_t p = 0; p < quads; ++p) {
    const __m512i b0 = _mm512_loadu_si512(b);
    const __m512i b1 = _mm512_loadu_si512(b + 64);
    const __m512i b2 = _mm512_loadu_si512(b + 128);
#define AP_ROW(r)                                        \
  {                                                      \
    const __m512i x = _mm512_set1_epi32(a[r]);           \
    c##r##0 = _mm512_dpbusd_epi32(c##r##0, b0, x);       \
    c##r##1 = _mm512_dpbusd_epi32(c##r##1, b1, x);       \
    c##r##2 = _mm512_dpbusd_epi32(c##r##2, b2, x);       \
  }
    AP_ROW(0) AP_ROW(1) AP_ROW(2) AP_ROW(3) AP_ROW(4) AP_ROW(5) AP_ROW(6) AP_ROW(7)
#undef AP_ROW
    a += MR;
    b += kStripBytes;
  }
#define AP_STORE(r)                                   \
  _mm512_storeu_si512(dst + r * ldd, c##r##0);        \
  _mm512_storeu_si512(dst + r * ldd + 16, c##r##1);   \
  _mm512_storeu_si512(dst + r * ldd + 32, c##r##2);
  AP_STORE(0) AP_STORE(1) AP_STORE(2) AP_STORE(3) AP_STORE(4) AP_STORE(5) AP_STORE(6) AP_STORE(7)
#undef AP_STORE
}

thread_local std::vector<uint8_t> t_panel;
thread_local std::vector<int32_t> t_scratch;

// The K quads of one packed chunk for `width` columns: the chunk (quads x width x 4 bytes) near
// kVnniPanelBytes, so it stays in L2.
int64_t chunk_quads(int64_t width) {
  const int64_t padded = (width + NR - 1) / NR * NR;
  return std::max<int64_t>(8, std::min<int64_t>(kVnniGemmDepth / 4, kVnniPanelBytes / 4 / padded));
}

}  // namespace

void int8_gemm_vnni(const int32_t* a, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0, int64_t r1,
                    int64_t n0, int64_t n1, int32_t* acc) {
  const int64_t quads = (k + 3) / 4, depth = chunk_quads(n1 - n0);
  const int32_t* sums = a + x_quads(m, k);
  const size_t need = static_cast<size_t>(std::min(depth, quads) * ((n1 - n0 + NR - 1) / NR) * kStripBytes);
  if (t_panel.size() < need) t_panel.resize(need);
  uint8_t* b = t_panel.data();
  alignas(64) int32_t tile[MR * NR];
  int32_t start[MR];
  for (int64_t q0 = 0; q0 < quads; q0 += depth) {
    const int64_t q1 = std::min(quads, q0 + depth), chunk = q1 - q0;
    pack_w(w, k, n, q0, q1, n0, n1, b);
    for (int64_t c = n0; c < n1; c += NR) {
      const uint8_t* strip = b + ((c - n0) / NR) * chunk * kStripBytes;
      const int64_t cols = std::min(NR, n1 - c);
      for (int64_t r = r0; r < r1; r += MR) {
        const int64_t rows = std::min(MR, std::min(m, r1) - r);
        const bool whole = rows == MR && cols == NR;
        const int32_t* ap = a + (r / MR) * quads * MR + q0 * MR;
        int32_t* out = acc + r * n + c;
        int32_t* dst = whole ? out : tile;
        const int64_t ldd = whole ? n : NR;
        if (q0 == 0) {
          for (int64_t rr = 0; rr < MR; ++rr)  // -128 * sum, in wrapping int32 arithmetic
            start[rr] = static_cast<int32_t>(0u - 128u * static_cast<uint32_t>(sums[r + rr]));
          micro(ap, strip, chunk, nullptr, 0, start, dst, ldd);
        } else if (whole) {
          micro(ap, strip, chunk, out, n, nullptr, out, n);
        } else {
          std::memset(tile, 0, sizeof tile);
          for (int64_t rr = 0; rr < rows; ++rr) std::memcpy(tile + rr * NR, out + rr * n, cols * sizeof(int32_t));
          micro(ap, strip, chunk, tile, NR, nullptr, tile, NR);
        }
        if (!whole)
          for (int64_t rr = 0; rr < rows; ++rr) std::memcpy(out + rr * n, tile + rr * NR, cols * sizeof(int32_t));
      }
    }
  }
}

namespace {

// out = term (first block) or out + term, term = float(sum) * scale: the portable path's float
// operations in its order. tile: rows x cols of int32 sums (ld NR).
void scale_tile(const int32_t* tile, int64_t rows, int64_t cols, const float* scale, bool first, float* out,
                int64_t ldo) {
  for (int64_t j = 0; j < cols; j += 16) {
    const __mmask16 mask = cols - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (cols - j)) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(mask, scale + j);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, tile + r * NR + j)), s);
      float* y = out + r * ldo + j;
      _mm512_mask_storeu_ps(y, mask, first ? term : _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), term));
    }
  }
}

}  // namespace

// int4: as int4_gemm_avx2 (a chunk holds whole blocks where blocks are short, each tile running
// its blocks one after the other, each ending in the scale epilogue; or part of one long block,
// whose int32 sums wait in a scratch between chunks), on quads: blocks a multiple of 4 K rows, or
// one block. Each block's sums start at -8 * sum(x over the block).
void int4_gemm_vnni(const int32_t* a, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                    const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out) {
  const int64_t quads = (k + 3) / 4, width = n1 - n0, padded = (m + MR - 1) / MR * MR;
  const int64_t groups = block >= k ? 1 : (k + block - 1) / block;
  const int64_t block_quads = groups == 1 ? quads : block / 4;
  const int32_t* sums = a + x_quads(m, k);
  int64_t depth = chunk_quads(width);
  if (block_quads <= depth) depth = depth / block_quads * block_quads;
  const size_t need = static_cast<size_t>(std::min(depth, quads) * ((width + NR - 1) / NR) * kStripBytes);
  if (t_panel.size() < need) t_panel.resize(need);
  uint8_t* b = t_panel.data();
  int32_t* scratch = nullptr;
  if (block_quads > depth) {
    const size_t cells = static_cast<size_t>((r1 - r0) * width);
    if (t_scratch.size() < cells) t_scratch.resize(cells);
    scratch = t_scratch.data();
  }
  alignas(64) int32_t tile[MR * NR];
  int32_t start[MR];
  for (int64_t q0 = 0; q0 < quads; q0 += depth) {
    const int64_t q1 = std::min(quads, q0 + depth), chunk = q1 - q0;
    pack_w4(w, k, n, q0, q1, n0, n1, b);
    for (int64_t c = n0; c < n1; c += NR) {
      const uint8_t* strip = b + ((c - n0) / NR) * chunk * kStripBytes;
      const int64_t cols = std::min(NR, n1 - c);
      for (int64_t r = r0; r < r1; r += MR) {
        const int64_t rows = std::min(MR, std::min(m, r1) - r);
        const int32_t* ap = a + (r / MR) * quads * MR;
        int32_t* keep = scratch == nullptr ? nullptr : scratch + (r - r0) * width + (c - n0);
        for (int64_t q = q0; q < q1;) {
          const int64_t g = q / block_quads, g0 = g * block_quads, g1 = std::min(quads, g0 + block_quads);
          const int64_t qe = std::min(q1, g1);
          const int32_t* aq = ap + q * MR;
          const uint8_t* bq = strip + (q - q0) * kStripBytes;
          if (q == g0) {
            for (int64_t rr = 0; rr < MR; ++rr)  // -8 * sum, in wrapping int32 arithmetic
              start[rr] = static_cast<int32_t>(0u - 8u * static_cast<uint32_t>(sums[g * padded + r + rr]));
            micro(aq, bq, qe - q, nullptr, 0, start, tile, NR);
          } else if (rows == MR && cols == NR) {
            micro(aq, bq, qe - q, keep, width, nullptr, tile, NR);
          } else {  // the scratch holds only this task's rows and columns
            std::memset(tile, 0, sizeof tile);
            for (int64_t rr = 0; rr < rows; ++rr) std::memcpy(tile + rr * NR, keep + rr * width, cols * sizeof(int32_t));
            micro(aq, bq, qe - q, tile, NR, nullptr, tile, NR);
          }
          if (qe == g1) {
            scale_tile(tile, rows, cols, scale + g * n + c, g == 0, out + r * n + c, n);
          } else {
            for (int64_t rr = 0; rr < rows; ++rr) std::memcpy(keep + rr * width, tile + rr * NR, cols * sizeof(int32_t));
          }
          q = qe;
        }
      }
    }
  }
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
