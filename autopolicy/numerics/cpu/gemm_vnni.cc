// The AVX512-VNNI GEMMs (gemm_tiles.h) for many rows of x (M >= gemm_min_rows()): an 8 x 48 tile
// of int32 sums in 24 ZMM registers; per quad of K rows 3 weight vectors, 8 broadcasts of x and 24
// vpdpbusd (64 products each).
#include "kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
#include <immintrin.h>

#include "gemm_tiles.h"

namespace autopolicy_cpu {
namespace {

struct Zmm8x48 : QuadLayout<48> {  // the micro-kernel below is written for this tile
  static constexpr int64_t MR = 8, NR = 48;

  // One tile over `quads` K quads: starts from `init` (ld ldi) or, where init is null, each row r
  // from start[r]; ends in dst (ld ldd; may be init). a: [quad][8] words, b: [quad][48] quads.
  __attribute__((always_inline)) static inline void micro(const int32_t* a, const uint8_t* b, int64_t quads,
                                                          const int32_t* init, int64_t ldi, const int32_t* start,
                                                          int32_t* dst, int64_t ldd) {
    __m512i c00, c01, c02, c10, c11, c12, c20, c21, c22, c30, c31, c32;
    __m512i c40, c41, c42, c50, c51, c52, c60, c61, c62, c70, c71, c72;
#define AP_INIT(r)                                             \
  if (init != nullptr) {                                       \
    c##r##0 = _mm512_loadu_si512(init + r * ldi);              \
    c##r##1 = _mm512_loadu_si512(init + r * ldi + 16);         \
    c##r##2 = _mm512_loadu_si512(init + r * ldi + 32);         \
  } else {                                                     \
    c##r##0 = c##r##1 = c##r##2 = _mm512_set1_epi32(start[r]); \
  }
    AP_INIT(0) AP_INIT(1) AP_INIT(2) AP_INIT(3) AP_INIT(4) AP_INIT(5) AP_INIT(6) AP_INIT(7)
#undef AP_INIT
    for (int64_t p = 0; p < quads; ++p) {
      const __m512i b0 = _mm512_loadu_si512(b);
      const __m512i b1 = _mm512_loadu_si512(b + 64);
      const __m512i b2 = _mm512_loadu_si512(b + 128);
#define AP_ROW(r)                                  \
  {                                                \
    const __m512i x = _mm512_set1_epi32(a[r]);     \
    c##r##0 = _mm512_dpbusd_epi32(c##r##0, b0, x); \
    c##r##1 = _mm512_dpbusd_epi32(c##r##1, b1, x); \
    c##r##2 = _mm512_dpbusd_epi32(c##r##2, b2, x); \
  }
      AP_ROW(0) AP_ROW(1) AP_ROW(2) AP_ROW(3) AP_ROW(4) AP_ROW(5) AP_ROW(6) AP_ROW(7)
#undef AP_ROW
      a += MR;
      b += NR * 4;
    }
#define AP_STORE(r)                                 \
  _mm512_storeu_si512(dst + r * ldd, c##r##0);      \
  _mm512_storeu_si512(dst + r * ldd + 16, c##r##1); \
  _mm512_storeu_si512(dst + r * ldd + 32, c##r##2);
    AP_STORE(0) AP_STORE(1) AP_STORE(2) AP_STORE(3) AP_STORE(4) AP_STORE(5) AP_STORE(6) AP_STORE(7)
#undef AP_STORE
  }

  // out = term (first block) or out + term, term = float(sum) * scale: the portable path's float
  // operations in its order. tile: rows x cols of int32 sums (ld NR).
  static void scale_tile(const int32_t* tile, int64_t rows, int64_t cols, const float* scale, bool first, float* out,
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
};

}  // namespace

const GemmX kQuadsZmmX{Zmm8x48::MR, Zmm8x48::NR, Zmm8x48::KG, quads_words<Zmm8x48::MR>, pack_x_quads<Zmm8x48::MR>};

void int8_gemm_vnni(const int32_t* a, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0, int64_t r1,
                    int64_t n0, int64_t n1, int32_t* acc) {
  int8_gemm_tiles<Zmm8x48>(a, m, k, w, n, r0, r1, n0, n1, acc);
}

void int4_gemm_vnni(const int32_t* a, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                    const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out) {
  int4_gemm_tiles<Zmm8x48>(a, m, k, w, n, block, scale, r0, r1, n0, n1, out);
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
