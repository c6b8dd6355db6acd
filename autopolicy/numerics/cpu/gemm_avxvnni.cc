// The AVX-VNNI GEMMs (gemm_tiles.h) for CPUs with the VEX-encoded vpdpbusd on YMM registers but
// no AVX-512 (Intel from Alder Lake, whose cores lack AVX-512): a 4 x 24 tile of int32 sums in 12
// YMM registers; per quad of K rows 3 weight vectors, 4 broadcasts of x and 12 vpdpbusd (32
// products each, where the AVX2 GEMM's vpmaddwd and vpaddd make 16).
#include "kernels.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
#include <immintrin.h>

#include "gemm_tiles.h"

namespace autopolicy_cpu {
namespace {

struct Ymm4x24 {
  static constexpr int64_t MR = kAvxVnniGemmRows, NR = kAvxVnniGemmStrip;
  static_assert(MR == 4 && NR == 24, "the micro-kernel is written for 4 x 24 tiles");
  static constexpr int64_t KG = 4, kDepthRows = kVnniGemmDepth, kPanelBytes = kVnniPanelBytes;
  static constexpr uint32_t kOffset8 = 128, kOffset4 = 8;
  static constexpr bool kPrefetchSums = false;

  static void pack8(const int8_t* w, int64_t k, int64_t n, int64_t g0, int64_t g1, int64_t c0, int64_t c1, uint8_t* b) {
    pack_w8<NR>(w, k, n, g0, g1, c0, c1, b);
  }
  static void pack4(const uint8_t* w, int64_t k, int64_t n, int64_t g0, int64_t g1, int64_t c0, int64_t c1, uint8_t* b) {
    pack_w4<NR>(w, k, n, g0, g1, c0, c1, b);
  }


  // As Zmm8x48::micro (gemm_vnni.cc). a: [quad][4] words, b: [quad][24] quads.
  __attribute__((always_inline)) static inline void micro(const int32_t* a, const uint8_t* b, int64_t quads,
                                                          const int32_t* init, int64_t ldi, const int32_t* start,
                                                          int32_t* dst, int64_t ldd) {
    __m256i c00, c01, c02, c10, c11, c12, c20, c21, c22, c30, c31, c32;
#define AP_INIT(r)                                                                  \
  if (init != nullptr) {                                                            \
    c##r##0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + r * ldi));      \
    c##r##1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + r * ldi + 8));  \
    c##r##2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + r * ldi + 16)); \
  } else {                                                                          \
    c##r##0 = c##r##1 = c##r##2 = _mm256_set1_epi32(start[r]);                      \
  }
    AP_INIT(0) AP_INIT(1) AP_INIT(2) AP_INIT(3)
#undef AP_INIT
    for (int64_t p = 0; p < quads; ++p) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
      const __m256i b2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64));
#define AP_ROW(r)                                      \
  {                                                    \
    const __m256i x = _mm256_set1_epi32(a[r]);         \
    c##r##0 = _mm256_dpbusd_avx_epi32(c##r##0, b0, x); \
    c##r##1 = _mm256_dpbusd_avx_epi32(c##r##1, b1, x); \
    c##r##2 = _mm256_dpbusd_avx_epi32(c##r##2, b2, x); \
  }
      AP_ROW(0) AP_ROW(1) AP_ROW(2) AP_ROW(3)
#undef AP_ROW
      a += MR;
      b += NR * 4;
    }
#define AP_STORE(r)                                                                  \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * ldd), c##r##0);      \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * ldd + 8), c##r##1);  \
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * ldd + 16), c##r##2);
    AP_STORE(0) AP_STORE(1) AP_STORE(2) AP_STORE(3)
#undef AP_STORE
  }

  static void scale_tile(const int32_t* tile, int64_t rows, int64_t cols, const float* scale, bool first, float* out,
                         int64_t ldo) {
    scale_tile_ymm<NR>(tile, rows, cols, scale, first, out, ldo);
  }
};

}  // namespace

const GemmX kQuadsYmmX{Ymm4x24::MR, Ymm4x24::NR, 4, quads_words<Ymm4x24::MR>, pack_x_quads<Ymm4x24::MR>};

void int8_gemm_avxvnni(const int32_t* a, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0, int64_t r1,
                       int64_t n0, int64_t n1, int32_t* acc) {
  int8_gemm_tiles<Ymm4x24>(a, m, k, w, n, r0, r1, n0, n1, acc);
}

void int4_gemm_avxvnni(const int32_t* a, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                       const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out) {
  int4_gemm_tiles<Ymm4x24>(a, m, k, w, n, block, scale, r0, r1, n0, n1, out);
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
