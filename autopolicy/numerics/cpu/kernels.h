// Integer matrix products for autopolicy's quantized layers on CPUs.
//
// Every kernel computes int32 accumulators of int8 activations (rows of x, quantized per row by
// the caller) against the package's own weight storage, for the output columns [n0, n1):
//   int8:  w is (K, N) int8, row-major;                acc[m, n] = sum_k x[m, k] * w[k, n]
//   int4:  w is (ceil(K/2), N) uint8, byte row j holding rows 2j and 2j + 1 in its low and
//          high nibbles (signed; Keras's layout), with a float scale per block of
//          `block` rows and column (scale: (G, N), G = ceil(K / block); per channel: block = K);
//          out[m, n] = sum_g float(sum over block g of x * w) * scale[g, n], in float32 (the
//          portable path sums the blocks in order, as the package's XLA path does).
// The instruction-set variants sit side by side behind one table (dispatch.cc), chosen at run
// time from the CPU's features; the portable variant is the reference every other is tested
// against. No state is kept across calls.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "weight_only.h"

namespace autopolicy_cpu {

using Int8Fn = void (*)(const int8_t* x, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t n0,
                        int64_t n1, int32_t* acc);
using Int4Fn = void (*)(const int8_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                        const float* scale, int64_t n0, int64_t n1, float* out);

// The GEMMs for many rows (gemm_tiles.h; gemm_avx2.cc, gemm_vnni.cc, gemm_avxvnni.cc): x packed
// once per call by the path's GemmX, each call then computing rows [r0, r1) (r0 a multiple of the
// layout's rows) and columns [n0, n1) of the same output.
using Int8GemmFn = void (*)(const int32_t* xp, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0,
                            int64_t r1, int64_t n0, int64_t n1, int32_t* acc);
using Int4GemmFn = void (*)(const int32_t* xp, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                            const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out);

// The GEMMs' blocking: tasks of at most kGemmCols columns; AVX2: a register tile of kGemmRows x
// kGemmStrip int32 sums, K chunks of at most kGemmDepth rows (even), packed into about
// kGemmPanelBytes (fewer rows for wider tasks); on vpdpbusd: K chunks of at most kVnniGemmDepth
// rows (a multiple of 4) packed into about kVnniPanelBytes, tiles of 8 x 48 (AVX512-VNNI, ZMM:
// gemm_vnni.cc) and 4 x 24 (AVX-VNNI, YMM: gemm_tiles.h's Ymm4x24).
// AVX2's chunks: up to 512 rows, so a strip (24 columns, 256 K pairs: 24 KB) stays in L1 while the
// row tiles walk it, in a panel of up to 1 MB (were 192 KB), so wide tasks keep deep chunks too
// (a 1024-wide task: 508 rows, where 192 KB allowed 94) and load and store each tile's int32 sums
// less often. Paired against 256 rows in 192 KB (benchmarks/ab_cpu_kernels.py, 2-core AMD EPYC
// Zen 3, AVX2): int8 4096 x 4096 1.13x [1.11-1.13] at batch 256 and 1.09x at 64, the 576-wide
// layers 0.94-1.07x. Chunks of up to 2048 rows (strips past L1 on narrow tasks of long K) ran
// 0.93-0.95x of these on 1536 x 576 at batch 64 and the same elsewhere (two runs of 15 rounds).
// The VNNI chunks were not re-measured (no VNNI CPU at the time).
constexpr int64_t kGemmRows = 4, kGemmStrip = 24, kGemmDepth = 512, kGemmCols = 1024;
constexpr int64_t kGemmPanelBytes = 1024 * 1024;
constexpr int64_t kVnniGemmDepth = 512, kVnniPanelBytes = 192 * 1024;

// How a path's GEMMs take x: packed once per call, in the first phase of its tasks, into panels
// of `rows` rows (`words(m, k, block)` int32 words for x (m, k)); pack(x, m, k, block, r0, r1, a)
// writes the panels of rows [r0, r1) (r0 a multiple of `rows`; r1 too, or m) from x, which holds
// those rows alone (row r0 first, k values a row), so a task can pack a panel it has just
// quantized while it is in its cache. The tiles' tasks are blocks of whole panels times blocks
// of columns, best a multiple of `strip` wide. K rows go `k_group` at a time (an int4 block must
// be a multiple of it, or all of K).
struct GemmX {
  int64_t rows, strip, k_group;
  int64_t (*words)(int64_t m, int64_t k, int64_t block);
  void (*pack)(const int8_t* x, int64_t m, int64_t k, int64_t block, int64_t r0, int64_t r1, int32_t* a);
};
extern const GemmX kPairsX;  // the AVX2 int8 GEMM's (pack_x_pairs)
// The quads GEMMs' (vpdpbusd on AVX512-VNNI and AVX-VNNI, AVX2's int4 on vpmaddubsw):
// [panel][quad][row] words (x_quads(m, k, rows) of them), then the sums of each row over each
// block of K rows, [block][panel * rows + row].
extern const GemmX kQuadsZmmX, kQuadsYmmX, kQuadsAvx2X;
inline int64_t x_quads(int64_t m, int64_t k, int64_t rows) { return (m + rows - 1) / rows * rows * ((k + 3) / 4); }

struct Path {
  const char* name;
  Int8Fn int8;
  Int4Fn int4;
  Int8GemmFn int8_gemm;  // null: the path has none (its int8/int4 kernels serve every M)
  Int4GemmFn int4_gemm;
  WeightOnlyFn weight_only;  // the GPTQ/AWQ product (weight_only.h) this path's CPUs run
  const GemmX* gemm_x;       // how int8_gemm takes x (null where the path has none)
  const GemmX* int4_gemm_x;  // how int4_gemm takes x (null where the path has none)
  int64_t int8_gemm_rows, int4_gemm_rows;  // the fewest rows of x each GEMM takes (gemm_min_rows)
};

// x (m, k) as kGemmRows-row panels of K pairs, each pair (x[2p], x[2p + 1]) one int32 word of two
// int16 (low: even row); rows past m and the pad of an odd K are zero. a: ceil(m / kGemmRows) *
// kGemmRows * ceil(k / 2) words, [panel][pair][row].
void pack_x_pairs(const int8_t* x, int64_t m, int64_t k, int32_t* a);
void int8_gemm_avx2(const int32_t* xp, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0, int64_t r1,
                    int64_t n0, int64_t n1, int32_t* acc);
// x as kQuadsAvx2X packs it (int8's takes kPairsX).
void int4_gemm_avx2(const int32_t* xp, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                    const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out);
void int8_gemm_vnni(const int32_t* xp, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0, int64_t r1,
                    int64_t n0, int64_t n1, int32_t* acc);
void int4_gemm_vnni(const int32_t* xp, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                    const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out);
void int8_gemm_avxvnni(const int32_t* xp, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t r0,
                       int64_t r1, int64_t n0, int64_t n1, int32_t* acc);
void int4_gemm_avxvnni(const int32_t* xp, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                       const float* scale, int64_t r0, int64_t r1, int64_t n0, int64_t n1, float* out);

// The integer an environment variable holds (the settings below read theirs once, at the first
// call), or `unset` where it is missing or empty.
int64_t env_int(const char* name, int64_t unset);

// The fewest rows of x for which the FFI calls the current path's GEMM, for the int8 (int4 =
// false) or int4 product; below, the streaming kernels. The paths' thresholds were measured
// (dispatch.cc); int64 max: never. set_gemm_min_rows sets one for both products on every path
// (tests, benchmarks; < 1 restores the paths' own), as AUTOPOLICY_CPU_GEMM_MIN_ROWS does at load.
int64_t gemm_min_rows(bool int4);
// The same for `path` (the one a call asked for, which need not be the current path).
int64_t gemm_min_rows(const Path& path, bool int4);
void set_gemm_min_rows(int64_t rows);

// bfloat16 (stored as its 16 bits) to and from float32; float_to_bf16 rounds to nearest even
// (NaN stays a quiet NaN), as XLA's convert does.
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline uint16_t float_to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// The float ends of the fused dense calls (quantize.cc), equal bit for bit to the package's XLA
// path. quantize_rows: each row of x (m, k), float32 or bfloat16 (bf16), to int8 with its scale
// (autopolicy.numerics.int8.quantize_symmetric). rescale_int8: columns [n0, n1) of
// out = float(acc) * (x_scale[row] * w_scale[col]) (+ bias[col] after rounding to the output
// dtype), out float32 or bfloat16 as bias (null: none); rescale_int4: out = y * x_scale[row]
// (+ bias). acc / y may be out itself (float32 out; read before written, element by element).
void quantize_rows(const void* x, bool bf16, int64_t m, int64_t k, int8_t* q, float* scale);
void rescale_int8(const int32_t* acc, int64_t m, int64_t n, const float* x_scale, const float* w_scale,
                  const void* bias, bool bf16, int64_t n0, int64_t n1, void* out);
void rescale_int4(const float* y, int64_t m, int64_t n, const float* x_scale, const void* bias, bool bf16,
                  int64_t n0, int64_t n1, void* out);

// Calls whose weights are fewer than serial_max_bytes() bytes (times the rows of x) run on the
// calling thread alone: below it, waking a pool thread and waiting for it costs more than the
// half of the work it would take (measured: dispatch.cc).
// set_serial_max_bytes sets it (tests, benchmarks; < 0 restores the default), as
// AUTOPOLICY_CPU_SERIAL_BYTES does at load.
int64_t serial_max_bytes();
void set_serial_max_bytes(int64_t bytes);

// The threads a call splits its work for: XLA's intra-op pool's (pool_threads), unless
// set_threads_override (or AUTOPOLICY_CPU_THREADS at load) names a count (< 1: the pool's again).
// More than the machine runs at once is allowed: the tasks are split as for that many threads
// and the helpers there are take them (tests split as a 16-core machine does).
int64_t call_threads(int64_t pool_threads);
int64_t threads_override();
void set_threads_override(int64_t threads);

// The package's own helper threads (helpers.cc), which poll for the next call for spin_us()
// microseconds after each one before they sleep. offer_to_helpers(helpers, job) has up to
// `helpers` of them run job() (each at most once; the caller must not depend on any of them
// running it: jobs claim their tasks from a counter) and returns true, or returns false and does
// nothing when spin_us() is 0 (AUTOPOLICY_CPU_SPIN_US=0: XLA's pool is used instead).
// set_spin_us sets it (< 0 restores the default), as AUTOPOLICY_CPU_SPIN_US does at load.
int64_t spin_us();
void set_spin_us(int64_t us);
// Calls whose x has at least pool_min_values() values (rows times K) hand their tasks to XLA's
// intra-op pool, not to the helpers above: XLA splits the fusions that make such an x over its
// pool, whose threads are then awake and polling when the call starts, and four threads on two
// cores left the helper's share late (measured: dispatch.cc). set_pool_min_values sets it (< 0
// restores the default), as AUTOPOLICY_CPU_POOL_VALUES does at load.
int64_t pool_min_values();
void set_pool_min_values(int64_t values);
bool offer_to_helpers(int64_t helpers, std::shared_ptr<const std::function<void()>> job);

// Waits, on a call's own thread, until `count` reaches `target` (its helpers' tasks finished):
// polled with a pause a few microseconds first, then yielding the core at each poll (for a helper
// descheduled onto it). A yield at every poll, as before, is a system call each time: the
// SmolLM2-135M int4 decode step on the AVX2 streams went from 3.75-3.89x float32 to 4.44-4.49x
// with this wait and int4's slab total (ffi.cc), two runs of each build in alternating processes
// (benchmarks/smollm2_cpu_paths.py, 2-core Zen 4 EPYC).
void wait_until(const std::atomic<int64_t>& count, int64_t target);

// An FFI buffer's dimensions as Python writes a shape: "(2, 3)", "(4,)" (for the FFI handlers'
// error messages; any sequence of integers with size() and operator[]).
template <typename Dims>
std::string dims_of(const Dims& d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

// Ranges of at most this many columns (a decoder's projections) prefetch the next pass's weight
// rows, which the thread reads microseconds later (and the AVX2 int8 byte stream takes 16 K rows
// a pass there, 8 over wider ones). Over wider ones (a 4096-column layer, an output head) the
// AVX2 int8 byte and int4 streams fetch each row's line kWideLead bytes ahead instead (the next
// pass's rows were measured slower there), and the AVX512-VNNI int8 stream leaves the long rows to
// the hardware prefetchers.
constexpr int64_t kNarrowColumns = 2048;

// Whether columns [n0, n1) are whole rows of the n-wide weights: then a streaming pass's rows, and
// the next pass's, are each one contiguous stretch, which the AVX2 and VNNI streams fetch ahead in
// order.
inline bool whole_rows(int64_t n0, int64_t n1, int64_t n) { return n0 == 0 && n1 == n; }

// x[i .. i + 3] as one int32 word, byte j = x[i + j] (bytes past k are zero: the pad rows
// contribute nothing): one quad of K rows, as vpdpbusd and the AVX2 byte kernel take it.
inline int32_t quad_of(const int8_t* x, int64_t i, int64_t k) {
  uint32_t v = 0;
  for (int64_t j = 0; j < 4 && i + j < k; ++j) v |= static_cast<uint32_t>(static_cast<uint8_t>(x[i + j])) << (8 * j);
  return static_cast<int32_t>(v);
}

// The portable reference path (plain C++).
void int8_portable(const int8_t* x, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1,
                   int32_t* acc);
void int4_portable(const int8_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
                   const float* scale, int64_t n0, int64_t n1, float* out);

// AVX2 (vpmaddwd on sign-extended 16-bit pairs: exact for every int8 value, -128 included).
void int8_avx2(const int8_t* x, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1,
               int32_t* acc);
void int4_avx2(const int8_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
               const float* scale, int64_t n0, int64_t n1, float* out);

// AVX512-VNNI (vpdpbusd on quads of K rows: the weights offset to unsigned bytes, the offset's
// share subtracted per row; gemv_vnni.cc). Columns past the last whole 64 go to the AVX2 kernels.
void int8_vnni(const int8_t* x, int64_t m, int64_t k, const int8_t* w, int64_t n, int64_t n0, int64_t n1,
               int32_t* acc);
void int4_vnni(const int8_t* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, int64_t block,
               const float* scale, int64_t n0, int64_t n1, float* out);

// The path this process uses: the best one the CPU supports, or the one AUTOPOLICY_CPU_PATH
// names (for tests), or the one set by set_path.
const Path& current_path();
// Sets the path by name ("portable", "avx2", "avx512_vnni"); returns false when unknown or unsupported here.
bool set_path(const char* name);
// Whether the CPU supports a path by name.
bool path_supported(const char* name);
// The error text of a call naming a path this CPU does not run: the paths it runs, the reference
// first, and the one in use.
std::string path_refusal(const std::string& name);
// The path a call names: the current one for an empty name, else the named one where the CPU
// supports it; null otherwise (the call fails naming it).
const Path* path_named(const std::string& name);

}  // namespace autopolicy_cpu
