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

struct Dpbusd {
  static inline __m256i add(__m256i sums, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(sums, w, x); }
};

struct AvxVnniTile : QuadLayout<24>, Ymm4x24<Dpbusd> {};

}  // namespace

const GemmX kQuadsYmmX{AvxVnniTile::MR, AvxVnniTile::NR, AvxVnniTile::KG, quads_words<AvxVnniTile::MR>, pack_x_quads<AvxVnniTile::MR>};

void int8_gemm_avxvnni(const int32_t* a, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0, int64_t r1,
                       int64_t n0, int64_t n1, int32_t* acc) {
  int8_gemm_tiles<AvxVnniTile>(a, m, k, w, n, r0, r1, n0, n1, acc);
}

void int4_gemm_avxvnni(const int32_t* a, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                       const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out) {
  int4_gemm_tiles<AvxVnniTile>(a, m, k, w, n, block, scale, r0, r1, n0, n1, out);
}

}  // namespace autopolicy_cpu

#pragma GCC pop_options
#endif  // __x86_64__
