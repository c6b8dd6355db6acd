// The run-time choice of instruction-set path: the CPU's features decide, never the build.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "kernels.h"

namespace autopolicy_cpu {
namespace {

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

// GEMM thresholds (the fewest rows of x a GEMM takes; below, the streaming kernels), measured:
// AVX2 on Zen 3 (reports/cpu-kernels-amd-epyc-avx2-2c.md): int8 from 16 rows (the stream wins
// below 12-16 rows at 4096 x 4096, up to 16-32 at 576 x 1536); int4 from 24 (its vpmaddubsw GEMM,
// kernel alone on the SmolLM2 shapes and 4096 x 4096, with its block end fused: 0.80-1.04x its
// stream at 16 rows, 1.00-1.11x at 24 per channel and 1.12-1.31x in blocks of 32; before that
// end, 0.91-1.21x at 24-32, 1.02-1.28x at 48, 0.99-1.72x at 256; the vpmaddwd GEMM it replaced
// never beat the stream). AVX512-VNNI on a 2-core Xeon (2026-11-26, kernel alone): the int8
// GEMM was 0.97-1.05x the stream at 8-12 rows, 1.1-1.2x at 16, 1.5x at 32 and 1.6-2.3x at 256
// on 4096 x 4096 and 576 x 1536; int4's GEMM 1.02-1.29x its stream at 16 rows, 1.3-2.2x at 256
// (per channel and in blocks of 32), below 16 slower. AVX-VNNI (the same Xeon, that path forced;
// 4096 x 4096, 576 x 1536 and 1536 x 576): int8's GEMM 1.0-1.4x the AVX2 stream already at 8
// rows (1.1-1.9x the AVX2 GEMM at 8-256); int4's 0.8-0.9x the AVX2 stream at 8 rows, 1.0-1.2x
// at 16, 1.2-1.5x from 32.
constexpr int64_t kInt8GemmRows = 16, kInt4VnniGemmRows = 16, kInt4Avx2GemmRows = 24;
constexpr int64_t kInt8AvxVnniGemmRows = 8, kInt4AvxVnniGemmRows = 16;

const Path kPortable{"portable", int8_portable, int4_portable, nullptr, nullptr, weight_only_portable,
                     nullptr, nullptr, kNever, kNever};
#if defined(__x86_64__)
const Path kAvx2{"avx2", int8_avx2, int4_avx2, int8_gemm_avx2, int4_gemm_avx2, weight_only_avx2,
                 &kPairsX, &kQuadsAvx2X, kInt8GemmRows, kInt4Avx2GemmRows};
const Path kAvx512Vnni{"avx512_vnni", int8_vnni, int4_vnni, int8_gemm_vnni, int4_gemm_vnni, weight_only_avx512,
                       &kQuadsZmmX, &kQuadsZmmX, kInt8GemmRows, kInt4VnniGemmRows};
// AVX2's streaming kernels with GEMMs on the VEX-encoded vpdpbusd (YMM, gemm_avxvnni.cc), for
// CPUs with AVX-VNNI but no AVX-512 (Intel client cores from Alder Lake).
const Path kAvxVnni{"avx_vnni", int8_avx2, int4_avx2, int8_gemm_avxvnni, int4_gemm_avxvnni, weight_only_avx2,
                    &kQuadsYmmX, &kQuadsYmmX, kInt8AvxVnniGemmRows, kInt4AvxVnniGemmRows};
#endif

bool cpu_has(const char* name) {
#if defined(__x86_64__)
  __builtin_cpu_init();
#endif
  if (std::strcmp(name, "portable") == 0) return true;
#if defined(__x86_64__)
  if (std::strcmp(name, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (std::strcmp(name, "avx_vnni") == 0) return cpu_has("avx2") && __builtin_cpu_supports("avxvnni");
  if (std::strcmp(name, "avx512_vnni") == 0)
    return cpu_has("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
#endif
  return false;
}

const Path* by_name(const char* name) {
  if (std::strcmp(name, "portable") == 0) return &kPortable;
#if defined(__x86_64__)
  if (std::strcmp(name, "avx2") == 0) return &kAvx2;
  if (std::strcmp(name, "avx_vnni") == 0) return &kAvxVnni;
  if (std::strcmp(name, "avx512_vnni") == 0) return &kAvx512Vnni;
#endif
  return nullptr;
}

const Path* best() {
  const char* forced = std::getenv("AUTOPOLICY_CPU_PATH");
  if (forced != nullptr && *forced != '\0') {
    const Path* path = by_name(forced);
    if (path != nullptr && cpu_has(forced)) return path;
  }
  for (const char* name : {"avx512_vnni", "avx_vnni", "avx2"}) {
    const Path* path = by_name(name);
    if (path != nullptr && cpu_has(name)) return path;
  }
  return &kPortable;
}

const Path* g_path = nullptr;

int64_t g_gemm_min_rows = -1;  // -1: not read yet; 0: the path's own thresholds
// Measured on two machines with different answers. benchmarks/bench_cpu_serial.py (a chain of
// calls on their own copies of the weights, as a decoder runs them) on the shared 2-core AVX2
// EPYC at loads 5 and 10 (never quiet) found serial faster for every SmolLM2 block layer, up to
// 864 KiB; on a quiet 2-core Xeon (AVX512-VNNI) serial/split was 0.72-0.73 at 54-108 KiB, 0.99
// and 1.16 at 162 and 324 KiB, 1.12-1.32 at 432-864 KiB, and SmolLM2-135M's int8 decode step ran
// 1.15-1.16x faster split from 64 or 256 KiB than from 1 MiB (int4/128: within the noise). A
// quiet machine is the one to tune for (a loaded one times nothing reliably): 128 KiB.
constexpr int64_t kSerialMaxBytes = 128 * 1024;
int64_t g_serial_max_bytes = -2;  // -2: not read yet
// In the search's timing loop (each call's x made by a fusion XLA splits over its pool), on the
// shared 2-core Zen 3 EPYC (AVX2), 31 interleaved rounds, XLA's pool as the helper against the
// package's own: 256 x 576 x 192 1.10x (int8) and 1.06x (int4), 256 x 576 x 576 1.10x and
// 1.06x, 256 x 1024 x 1024 1.12x and 1.13x, 128 x 384 x 1536 (49K values) 1.05x and 1.08x;
// 64 x 576 x 1536 0.98x and 0.99x, 32 x 576 x 576 0.98x and 0.96x, 16 x 576 x 576 0.99x and 0.98x.
// With this default against the helpers only (benchmarks/bench_cpu_pool.py, 31 rounds): int8
// 1.02-1.30x and int4 1.04-1.19x at 256 and 512 rows, 0.99-1.04x below (the same code).
constexpr int64_t kPoolMinValues = 1 << 17;  // cpu_kernels.POOL_MIN_VALUES_DEFAULT
int64_t g_pool_min_values = -2;  // -2: not read yet
int64_t g_threads = -2;           // -2: not read yet; 0: XLA's pool's

}  // namespace

int64_t env_int(const char* name, int64_t unset) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::atoll(value) : unset;
}

const Path& current_path() {
  if (g_path == nullptr) g_path = best();
  return *g_path;
}

bool set_path(const char* name) {
  const Path* path = by_name(name);
  if (path == nullptr || !cpu_has(name)) return false;
  g_path = path;
  return true;
}

int64_t gemm_min_rows(const Path& path, bool int4) {
  if (g_gemm_min_rows < 0) {
    set_gemm_min_rows(env_int("AUTOPOLICY_CPU_GEMM_MIN_ROWS", 0));
  }
  if (g_gemm_min_rows > 0) return g_gemm_min_rows;
  return int4 ? path.int4_gemm_rows : path.int8_gemm_rows;
}

int64_t gemm_min_rows(bool int4) { return gemm_min_rows(current_path(), int4); }

void set_gemm_min_rows(int64_t rows) { g_gemm_min_rows = rows < 1 ? 0 : rows; }

int64_t serial_max_bytes() {
  if (g_serial_max_bytes == -2) {
    set_serial_max_bytes(env_int("AUTOPOLICY_CPU_SERIAL_BYTES", -1));
  }
  return g_serial_max_bytes;
}

void set_serial_max_bytes(int64_t bytes) { g_serial_max_bytes = bytes < 0 ? kSerialMaxBytes : bytes; }

int64_t pool_min_values() {
  if (g_pool_min_values == -2) {
    set_pool_min_values(env_int("AUTOPOLICY_CPU_POOL_VALUES", -1));
  }
  return g_pool_min_values;
}

void set_pool_min_values(int64_t values) { g_pool_min_values = values < 0 ? kPoolMinValues : values; }

int64_t threads_override() {
  if (g_threads == -2) {
    set_threads_override(env_int("AUTOPOLICY_CPU_THREADS", 0));
  }
  return g_threads;
}

void set_threads_override(int64_t threads) { g_threads = threads < 1 ? 0 : threads; }

int64_t call_threads(int64_t pool_threads) {
  const int64_t forced = threads_override();
  return forced > 0 ? forced : std::max<int64_t>(1, pool_threads);
}

bool path_supported(const char* name) { return by_name(name) != nullptr && cpu_has(name); }

std::string path_refusal(const std::string& name) {
  std::string names;
  for (const char* supported : {"portable", "avx2", "avx_vnni", "avx512_vnni"})
    if (path_supported(supported)) names += std::string(names.empty() ? "'" : ", '") + supported + "'";
  return "path '" + name + "' is not one this CPU runs; it runs " + names + " (or '' for the one in use, '" +
         current_path().name + "')";
}

const Path* path_named(const std::string& name) {
  if (name.empty()) return &current_path();
  return path_supported(name.c_str()) ? by_name(name.c_str()) : nullptr;
}

}  // namespace autopolicy_cpu
