// The XLA FFI binding: checks shapes and dtypes (naming the bad one), splits the output columns
// over as many threads as XLA's intra-op pool has (the package's own polling helpers, helpers.cc,
// or XLA's pool itself with AUTOPOLICY_CPU_SPIN_US=0; the caller takes its share too; calls too
// small to pay for a second thread run on the caller alone), and runs the kernel of the SIMD
// path the call names in its "path" attribute ("": the one in use; kernels.h's path_named). The
// dense targets take the float input and return the float output: the row quantization before and
// the rescale (and bias) after run here too (quantize.cc), not as XLA ops around the call; the
// grouped dense targets do several products of one input in one call. No state across calls.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace autopolicy_cpu {
namespace {

constexpr int64_t kColumnsPerTask = 64;
// The int8 product of few rows (at most kSlabMaxRows) splits K into up to kSlabs slabs of at
// least kSlabRows rows.
constexpr int64_t kSlabs = 8, kSlabRows = 256, kSlabMaxRows = 4;
// Where the slabs are fewer than the threads (a short K on a many-core machine: 576 rows make
// two), each slab's columns split too, into as many parts as the threads need, of at least
// kSlabMinColumns columns.
constexpr int64_t kSlabMinColumns = 256;
// Per-channel int4 of few rows splits K into slabs from kInt4SlabMinK rows (from
// kInt4NarrowSlabMinK at up to kInt4NarrowSlabMaxRows rows over at most kNarrowColumns columns)
// up to the longest K whose sums stay exact in float32 (127 * 8 * K < 2**24).
constexpr int64_t kInt4SlabMinK = 2048, kInt4NarrowSlabMinK = 512, kInt4NarrowSlabMaxRows = 2, kInt4ExactK = 16512;
// Rescaled outputs (rows x columns) up to this many run on the calling thread alone.
constexpr int64_t kSerialEpilogue = 1 << 16;
// x is quantized (and packed for a GEMM) on the threads from this many values, else on the calling
// thread alone.
constexpr int64_t kParallelQuantize = 1 << 16;

// Where a call's tasks run: on helpers (ours or XLA's pool's, as many as XLA's pool has threads
// but one) and the calling thread, or (serial) on the calling thread alone, for work too small to
// pay for a second thread.
// xla_pool: the other threads are XLA's pool's, not the package's helpers (pool_min_values).
struct Runner {
  ffi::ThreadPool* pool;
  bool serial;
  bool xla_pool = false;
  int64_t threads() const { return serial ? 1 : call_threads(pool->num_threads()); }
};

// x_values: the values of the call's x (rows times K).
Runner runner_for(ffi::ThreadPool& pool, int64_t work_bytes, int64_t x_values) {
  return Runner{&pool, work_bytes <= serial_max_bytes(), x_values >= pool_min_values()};
}

// Runs body(t) for t in [0, tasks), on the helpers and the calling thread (parallel.h).
template <typename Body>
void parallel_tasks(const Runner& run_on, int64_t tasks, Body body) {
  share_tasks(*run_on.pool, tasks, run_on.threads(), body, run_on.xla_pool);
}

// Runs body(n0, n1) over [0, n) in one chunk per thread.
template <typename Body>
void parallel_columns(const Runner& run_on, int64_t n, int64_t min_chunk, Body body) {
  int64_t chunks = std::min<int64_t>(run_on.threads(), std::max<int64_t>(1, n / min_chunk));
  if (chunks <= 1) {
    body(0, n);
    return;
  }
  int64_t step = (n + chunks - 1) / chunks;
  step = (step + 63) / 64 * 64;  // whole SIMD chunks (64 columns: the VNNI kernels')
  chunks = (n + step - 1) / step;
  parallel_tasks(run_on, chunks, [=](int64_t c) { body(c * step, std::min(n, (c + 1) * step)); });
}

// The GEMM's tiles for one product: blocks of at most kGemmCols columns (whole strips) times
// blocks of rows (whole panels), at least two per thread where the shape allows (the machine is
// shared: a thread that runs late then delays the call by less than its whole share).
struct TileGrid {
  int64_t row_step, col_step, row_tasks, col_tasks;
  int64_t tasks() const { return row_tasks * col_tasks; }
};

TileGrid tile_grid(int64_t threads, int64_t m, int64_t n, int64_t tile_rows, int64_t strip) {
  if (m <= 0 || n <= 0) return TileGrid{1, 1, 0, 0};
  const int64_t want = 2 * threads;
  int64_t strips = (n + strip - 1) / strip;
  int64_t col_tasks = (n + kGemmCols - 1) / kGemmCols;
  if (col_tasks < want) col_tasks = std::min(strips, want);
  const int64_t col_step = (strips + col_tasks - 1) / col_tasks * strip;
  col_tasks = (n + col_step - 1) / col_step;
  // At most about 256 rows a task (whole panels), so that a K chunk of x stays in L2 (256 KB of
  // AVX2 pairs at 512 K rows). Each row block packs its columns' weights again: against 192
  // rows (two row blocks at batch 256), 256 ran int8 1.00-1.18x at batch 256 on the SmolLM2
  // shapes and 4096 x 4096 and 0.95-1.10x at 384-512 (benchmarks/ab_cpu_kernels.py, 9-11
  // rounds, 2-core Zen 3 EPYC, AVX2); int4 0.96-1.09x. The VNNI tiles were not measured.
  const int64_t panels = (m + tile_rows - 1) / tile_rows;
  const int64_t most = std::max<int64_t>(1, (256 + tile_rows - 1) / tile_rows);
  int64_t row_tasks = std::min(panels, std::max<int64_t>(1, (want + col_tasks - 1) / col_tasks));
  row_tasks = std::max(row_tasks, (panels + most - 1) / most);
  const int64_t row_step = (panels + row_tasks - 1) / row_tasks * tile_rows;
  row_tasks = (m + row_step - 1) / row_step;
  return TileGrid{row_step, col_step, row_tasks, col_tasks};
}

// Runs body(s, n0, n1) for each of `slabs` slabs over columns [n0, n1): the whole of [0, n) where
// the slabs keep every thread busy, else a share of it (whole 64-column chunks: the VNNI
// kernels'). On two threads, any K long enough for two slabs takes them whole. Measured on a
// 16-core Xeon (AVX-512 VNNI, AMX): the int8 576 x 49152 head at batch 1 ran at 1.20x float32
// with its two slabs whole, see reports/cpu-kernels-intel-xeon-processor-amx-int8-16c.md.
template <typename Body>
void parallel_slabs(const Runner& run_on, int64_t slabs, int64_t n, Body body) {
  const int64_t threads = run_on.threads();
  int64_t parts = std::min((threads + slabs - 1) / slabs, std::max<int64_t>(1, n / kSlabMinColumns));
  int64_t step = n;
  if (parts > 1) {
    step = ((n + parts - 1) / parts + 63) / 64 * 64;
    parts = (n + step - 1) / step;
  }
  parallel_tasks(run_on, slabs * parts, [=](int64_t t) {
    const int64_t s = t / parts, c = t % parts;
    body(s, c * step, std::min(n, (c + 1) * step));
  });
}

ffi::Error bad(const std::string& what) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, what); }

// The slabs' length for `slabs` slabs of K: a multiple of 4 (whole quads and int4 byte pairs).
int64_t slab_step(int64_t k, int64_t slabs) { return (k / slabs + 3) / 4 * 4; }

// Columns [k0, k1) of the m rows of x (m, k), contiguous: one slab's rows of x.
std::vector<int8_t> slab_of(const int8_t* xp, int64_t m, int64_t k, int64_t k0, int64_t k1) {
  std::vector<int8_t> xs(static_cast<size_t>(m * (k1 - k0)));
  for (int64_t r = 0; r < m; ++r) std::copy(xp + r * k + k0, xp + r * k + k1, xs.data() + r * (k1 - k0));
  return xs;
}

// The float end of a fused dense call (quantize.cc's rescale_int8 / rescale_int4), which the
// GEMMs' tasks apply to their own block of the output as soon as its sums are done, while the
// block is still in the task's caches: a pass of its own over the whole output, after the
// product, re-read the sums from memory (a 1024 x 384 x 384 int8 layer: the rescale took 14% of
// the GEMM's CPU time that way, perf on the 2-core Zen 3 EPYC, AVX2 path).
struct Rescale {
  const float* x_scale;
  const float* w_scale;  // int8's per column (unused for int4)
  const void* bias;      // null: none
  bool bf16;
  void* out;

  // Rows [r0, r1), columns [n0, n1) of int8's int32 sums or int4's float sums.
  void rows(const int32_t* acc, int64_t n, int64_t r0, int64_t r1, int64_t n0, int64_t n1) const {
    rescale_int8(acc + r0 * n, r1 - r0, n, x_scale + r0, w_scale, bias, bf16, n0, n1, out_row(r0, n));
  }
  void rows(const float* y, int64_t n, int64_t r0, int64_t r1, int64_t n0, int64_t n1) const {
    rescale_int4(y + r0 * n, r1 - r0, n, x_scale + r0, bias, bf16, n0, n1, out_row(r0, n));
  }
  void* out_row(int64_t r, int64_t n) const {
    return bf16 ? static_cast<void*>(static_cast<uint16_t*>(out) + r * n) : static_cast<void*>(static_cast<float*>(out) + r * n);
  }
};

// The rescale as a pass of its own over all m rows (the streaming kernels' products), split
// over the threads by columns where the output is large.
template <typename Sums>
void rescale_pass(ffi::ThreadPool& pool, const Sums* sums, int64_t m, int64_t n, const Rescale& rescale) {
  parallel_columns(Runner{&pool, m * n <= kSerialEpilogue}, n, kColumnsPerTask,
                   [=, &rescale](int64_t n0, int64_t n1) { rescale.rows(sums, n, 0, m, n0, n1); });
}

// --- the GEMM calls (many rows of x): x packed into the path's layout (quantized first where it
// is float) and the tiles of one or more products, in one parallel region of two phases: a run of
// rows of x per task, then every product's tiles, each rescaled by the task that computed it
// (Rescale above). One region wakes the other threads once, while the first rows are
// quantized, and packs on every thread; a grouped call's products share it. Before, a call took
// three regions (the quantizer's, a serial pack, the tiles') and a grouped call one more per
// product. Measured on the 2-core Zen 3 EPYC (AVX2): single int8 layers gained little, within the
// noise (benchmarks/ab_cpu_kernels.py --layers, 61 paired rounds, SmolLM2's 576 x 192, 576 x 576
// and 1536 x 576 at batches 64 and 256: 0.96-1.07x, where the unchanged int4 streaming kernels
// read 1.00-1.07x); a grouped q/k/v call (576 -> 576, 192, 192) at 256 rows ran at 1.09-1.16x its
// three separate calls, where it had run at 1.03-1.04x.

// Whether the path's GEMM takes this product (int4: K rows go k_group at a time, AVX2 pairs or
// VNNI quads, and none may straddle a block).
bool gemm_applies(const Path& path, bool int4, int64_t m, int64_t k, int64_t block) {
  if (int4)
    return path.int4_gemm != nullptr && (block >= k || block % path.int4_gemm_x->k_group == 0) &&
           m >= gemm_min_rows(path, true);
  return path.int8_gemm != nullptr && m >= gemm_min_rows(path, false) && k > 0;
}

// One product of a GEMM call: the weights (int8 (K, N), or int4 packed (ceil(K/2), N) with its
// block scales (G, N)), its sums (int32 for int8, float32 for int4) and its rescale (null: none).
struct GemmProduct {
  const void* w;
  int64_t n;
  const float* block_scale;
  void* sums;
  const Rescale* rescale;
};

// x of a GEMM call: quantized (q), or float (M, K) rows to quantize here (float_x, bfloat16
// where bf16), their scales into x_scale.
struct GemmInput {
  const int8_t* q;
  const char* float_x = nullptr;
  bool bf16 = false;
  float* x_scale = nullptr;
};

void gemm_call(ffi::ThreadPool& pool, const Path& path, bool int4, const GemmInput& x, int64_t m, int64_t k,
               int64_t block, const GemmProduct* products, int64_t count) {
  const GemmX& layout = int4 ? *path.int4_gemm_x : *path.gemm_x;
  int64_t work = 0;
  for (int64_t i = 0; i < count; ++i) work += m * (int4 ? (k + 1) / 2 : k) * products[i].n;
  const Runner run_on = runner_for(pool, work, m * k);
  const int64_t threads = run_on.threads();
  // Left uninitialized: the pack writes every word.
  std::unique_ptr<int32_t[]> packed(new int32_t[static_cast<size_t>(layout.words(m, k, block))]);
  int32_t* a = packed.get();
  // The first phase: runs of whole panels of rows, one per thread from kParallelQuantize values.
  const int64_t panels = (m + layout.rows - 1) / layout.rows;
  const int64_t runs = m * k < kParallelQuantize ? 1 : std::min(panels, threads);
  const int64_t run_rows = (panels + runs - 1) / runs * layout.rows, first = (m + run_rows - 1) / run_rows;
  // The second: each product's tiles, after those of the products before it.
  std::vector<TileGrid> grids;
  std::vector<int64_t> starts;
  int64_t tasks = first;
  for (int64_t i = 0; i < count; ++i) {
    grids.push_back(tile_grid(threads, m, products[i].n, layout.rows, layout.strip));
    starts.push_back(tasks);
    tasks += grids.back().tasks();
  }
  const TileGrid* gp = grids.data();
  const int64_t* sp = starts.data();
  const int64_t row_bytes = k * (x.bf16 ? 2 : 4);
  Int8GemmFn gemm8 = path.int8_gemm;
  Int4GemmFn gemm4 = path.int4_gemm;
  share_tasks(*run_on.pool, tasks, threads, [=, &layout, &x](int64_t t) {
    if (t < first) {
      const int64_t r0 = t * run_rows, r1 = std::min(m, r0 + run_rows);
      if (x.float_x == nullptr) {
        layout.pack(x.q + r0 * k, m, k, block, r0, r1, a);
        return;
      }
      // A panel at a time through a buffer that stays in this thread's cache: the quantized x is
      // never written out whole (nor read back).
      thread_local std::vector<int8_t> panel;
      if (panel.size() < static_cast<size_t>(layout.rows * k)) panel.resize(static_cast<size_t>(layout.rows * k));
      for (int64_t r = r0; r < r1; r += layout.rows) {
        const int64_t e = std::min(r1, r + layout.rows);
        quantize_rows(x.float_x + r * row_bytes, x.bf16, e - r, k, panel.data(), x.x_scale + r);
        layout.pack(panel.data(), m, k, block, r, e, a);
      }
      return;
    }
    const int64_t i = std::upper_bound(sp, sp + count, t) - sp - 1, cell = t - sp[i];
    const TileGrid& g = gp[i];
    const GemmProduct& p = products[i];
    const int64_t r0 = cell / g.col_tasks * g.row_step, n0 = cell % g.col_tasks * g.col_step;
    const int64_t r1 = std::min(m, r0 + g.row_step), n1 = std::min(p.n, n0 + g.col_step);
    if (int4) {
      float* y = static_cast<float*>(p.sums);
      gemm4(a, m, k, static_cast<const uint8_t*>(p.w), p.n, block, p.block_scale, r0, r1, n0, n1, y);
      if (p.rescale != nullptr) p.rescale->rows(y, p.n, r0, r1, n0, n1);
    } else {
      int32_t* acc = static_cast<int32_t*>(p.sums);
      gemm8(a, m, k, static_cast<const int8_t*>(p.w), p.n, r0, r1, n0, n1, acc);
      if (p.rescale != nullptr) p.rescale->rows(acc, p.n, r0, r1, n0, n1);
    }
  }, run_on.xla_pool, first);
}

// acc = xq @ w in int32 for int8 xq (m, k) and w (k, n); with `rescale`, rescaled into
// rescale->out as well: by the GEMM's tasks, each its own block, or in a pass after the streams.
void int8_product(ffi::ThreadPool& pool, const Path& path, const int8_t* xp, int64_t m, int64_t k, const int8_t* wp,
                  int64_t n, int32_t* out, const Rescale* rescale = nullptr) {
  if (gemm_applies(path, false, m, k, k)) {
    const GemmProduct product{wp, n, nullptr, out, rescale};
    gemm_call(pool, path, false, GemmInput{xp}, m, k, k, &product, 1);
    return;
  }
  const Runner run_on = runner_for(pool, m * k * n, m * k);
  const int64_t slabs = std::min<int64_t>(kSlabs, k / kSlabRows);
  if (!run_on.serial && m <= kSlabMaxRows && slabs > 1 && n >= 16) {
    // Few rows: slabs of K rows, each a contiguous stretch of the weights (one stream the
    // prefetchers follow, where a column split reads pieces of every row), claimed by the
    // threads as they come free; each slab's int32 sums are added at the end (exact).
    const int64_t step = slab_step(k, slabs), count = (k + step - 1) / step;
    // Left uninitialized, as int4's: each slab's first pass writes every sum (zeroed here, each
    // line went from the calling thread's cache to the helper's; no difference could be told in
    // benchmarks/ab_cpu_kernels.py --layers at batches 1-2, 0.95-1.05x, 2-core EPYC, AVX2).
    std::unique_ptr<int32_t[]> partial(new int32_t[static_cast<size_t>((count - 1) * m * n)]);
    int32_t* parts = partial.get();
    parallel_slabs(run_on, count, n, [=, &path](int64_t s, int64_t n0, int64_t n1) {
      const int64_t k0 = s * step, k1 = std::min(k, k0 + step);
      const std::vector<int8_t> xs = slab_of(xp, m, k, k0, k1);
      path.int8(xs.data(), m, k1 - k0, wp + k0 * n, n, n0, n1, s == 0 ? out : parts + (s - 1) * m * n);
    });
    for (int64_t s = 1; s < count; ++s) {
      const int32_t* src = parts + (s - 1) * m * n;
      for (int64_t i = 0; i < m * n; ++i) out[i] += src[i];
    }
  } else {
    parallel_columns(run_on, n, kColumnsPerTask, [=, &path](int64_t n0, int64_t n1) { path.int8(xp, m, k, wp, n, n0, n1, out); });
  }
  if (rescale != nullptr)
    rescale_pass(pool, out, m, n, *rescale);
}

// y = sum over blocks of float(xq @ w_block) * scale_block, float32, for int8 xq (m, k) and the
// packed int4 w (ceil(k / 2), n), scale (ceil(k / block), n).
// (With `rescale`: as int8_product.)
void int4_product(ffi::ThreadPool& pool, const Path& path, const int8_t* xp, int64_t m, int64_t k, const uint8_t* wp,
                  int64_t n, int64_t block, const float* sp, float* yp, const Rescale* rescale = nullptr) {
  const int64_t groups = (k + block - 1) / block;
  // SIMD paths take rows in pairs (2j, 2j + 1): a pair must not straddle a block.
  const bool pairs_ok = groups == 1 || block % 2 == 0;
  const Runner run_on = runner_for(pool, m * ((k + 1) / 2) * n, m * k);
  Int4Fn fn = pairs_ok ? path.int4 : int4_portable;
  if (gemm_applies(path, true, m, k, block)) {
    const GemmProduct product{wp, n, sp, yp, rescale};
    gemm_call(pool, path, true, GemmInput{xp}, m, k, block, &product, 1);
    return;
  }
  const int64_t slabs = std::min<int64_t>(kSlabs, k / kSlabRows);
  const bool narrow_slabs = k >= kInt4NarrowSlabMinK && n <= kNarrowColumns && m <= kInt4NarrowSlabMaxRows;
  if (!run_on.serial && groups == 1 && (k >= kInt4SlabMinK || narrow_slabs) && k <= kInt4ExactK && m <= kSlabMaxRows &&
      n >= 32) {
    // Per channel, few rows, long K: slabs of K rows as int8_product takes them (each one stream
    // over whole rows, with the wide ranges' fetching ahead), each run with unit scales, so its
    // outputs are its int32 sums as floats, exact (|sum| <= 127 * 8 * K < 2**24), and so is their
    // total; times the scales, the values of the single pass, bit for bit. Against the column
    // split: 4096 x 4096 1.11-1.15x at batch 1, 1.03-1.18x at 2 (four runs); 1536 x 576
    // 0.93-1.04x (two runs), so shorter K kept the column split (benchmarks/ab_cpu_kernels.py
    // --layers, 41 rounds a run, 2-core AMD EPYC, AVX2; int8, unchanged, 0.98-1.02x). Since the
    // stream fetches the next pass of whole narrow rows in order (gemv_avx2.cc), narrow layers
    // from K = 512 split too at batch 1-2 (576- and 1536-long K, 192-1536 wide: see int4_stream;
    // at batch 4 0.90-1.01x, at 3 0.97-1.12x, two runs each); the 576 x 49152 head did not gain
    // from slabs (0.60-0.63x) and keeps the column split.
    // The first slab's sums go straight to y, the others' to a scratch left uninitialized (each
    // slab writes all of its m x n). The total is then taken row by row, in slab order, as
    // contiguous runs the compiler vectorizes: the element-wise loop it replaced (a modulo per
    // element, the slabs strided) took a quarter of a 576 x 1536 call's time on the calling
    // thread while the helper waited (perf, 2-core Zen 4).
    const int64_t step = slab_step(k, slabs), count = (k + step - 1) / step;
    std::unique_ptr<float[]> partial(new float[static_cast<size_t>((count - 1) * m * n)]);
    // The unit scales, kept by the thread: filling n of them afresh was most of this function's
    // own time in the perf profile above.
    thread_local std::vector<float> ones;
    if (ones.size() < static_cast<size_t>(n)) ones.assign(static_cast<size_t>(n), 1.0f);
    float* parts = partial.get();
    const float* unit = ones.data();
    parallel_slabs(run_on, count, n, [=](int64_t s, int64_t n0, int64_t n1) {
      const int64_t k0 = s * step, k1 = std::min(k, k0 + step);
      const std::vector<int8_t> xs = slab_of(xp, m, k, k0, k1);
      fn(xs.data(), m, k1 - k0, wp + (k0 / 2) * n, n, k1 - k0, unit, n0, n1, s == 0 ? yp : parts + (s - 1) * m * n);
    });
    for (int64_t r = 0; r < m; ++r) {
      float* y = yp + r * n;
      for (int64_t s = 1; s < count; ++s) {
        const float* src = parts + (s - 1) * m * n + r * n;
        for (int64_t c = 0; c < n; ++c) y[c] += src[c];
      }
      for (int64_t c = 0; c < n; ++c) y[c] *= sp[c];
    }
  } else {
    parallel_columns(run_on, n, kColumnsPerTask, [=](int64_t n0, int64_t n1) { fn(xp, m, k, wp, n, block, sp, n0, n1, yp); });
  }
  if (rescale != nullptr)
    rescale_pass(pool, yp, m, n, *rescale);
}

// The error of a call naming a path this CPU does not run (or no path at all).
ffi::Error unknown_path(const char* what, std::string_view name) {
  return bad(std::string(what) + ": " + path_refusal(std::string(name)));
}

ffi::Error Int8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w, std::string_view path_name,
                    ffi::ResultBuffer<ffi::S32> acc) {
  const Path* path = path_named(std::string(path_name));
  if (path == nullptr) return unknown_path("autopolicy int8 matmul", path_name);
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2) return bad("autopolicy int8 matmul: x must be (M, K); its rank is " + std::to_string(xd.size()));
  if (wd.size() != 2 || wd[0] != xd[1])
    return bad("autopolicy int8 matmul: the kernel must be (K, N) with K = " + std::to_string(xd[1]));
  int8_product(pool, *path, x.typed_data(), xd[0], xd[1], w.typed_data(), wd[1], acc->typed_data());
  return ffi::Error::Success();
}

// The packed int4 kernel's and its scale's shapes for x (m, k) and a block of `block` rows.
ffi::Error check_int4(const char* what, int64_t k, ffi::Span<const int64_t> wd, ffi::Span<const int64_t> sd,
                      int64_t block) {
  if (wd.size() != 2 || wd[0] != (k + 1) / 2)
    return bad(std::string(what) + ": the packed kernel must be (ceil(K/2), N) with K = " + std::to_string(k) +
               "; it is " + dims_of(wd));
  if (block <= 0 || block > k)
    return bad(std::string(what) + ": block must be in [1, K] = [1, " + std::to_string(k) + "]; got " + std::to_string(block));
  const int64_t groups = (k + block - 1) / block;
  if (sd.size() != 2 || sd[0] != groups || sd[1] != wd[1])
    return bad(std::string(what) + ": the scale must be (G, N) = (" + std::to_string(groups) + ", " +
               std::to_string(wd[1]) + "); it is " + dims_of(sd));
  return ffi::Error::Success();
}

ffi::Error Int4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> scale,
                    int64_t block, std::string_view path_name, ffi::ResultBuffer<ffi::F32> out) {
  const Path* path = path_named(std::string(path_name));
  if (path == nullptr) return unknown_path("autopolicy int4 matmul", path_name);
  auto xd = x.dimensions();
  if (xd.size() != 2) return bad("autopolicy int4 matmul: x must be (M, K); its rank is " + std::to_string(xd.size()));
  const int64_t m = xd[0], k = xd[1];
  if (ffi::Error e = check_int4("autopolicy int4 matmul", k, w.dimensions(), scale.dimensions(), block); e.failure())
    return e;
  int4_product(pool, *path, x.typed_data(), m, k, w.typed_data(), w.dimensions()[1], block, scale.typed_data(),
               out->typed_data());
  return ffi::Error::Success();
}

// --- the fused dense calls: float x quantized per row, the integer product, the rescale (+ bias)

bool is_float(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

// Checks the float operands of a fused call: x (M, K), out (M, N), bias (N,) in out's dtype or
// empty (or none: null); float32 or bfloat16 each.
ffi::Error check_floats(const char* what, const ffi::AnyBuffer& x, const ffi::AnyBuffer* bias,
                        ffi::Result<ffi::AnyBuffer>& out, int64_t n) {
  auto xd = x.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || !is_float(x.element_type()))
    return bad(std::string(what) + ": x must be a (M, K) float32 or bfloat16 array; it is " + dims_of(xd));
  if (od.size() != 2 || od[0] != xd[0] || od[1] != n || !is_float(out->element_type()))
    return bad(std::string(what) + ": the output must be float32 or bfloat16 (" + std::to_string(xd[0]) + ", " +
               std::to_string(n) + "); it is " + dims_of(od));
  const int64_t nb = bias == nullptr ? 0 : static_cast<int64_t>(bias->element_count());
  if (nb != 0 && (nb != n || bias->element_type() != out->element_type()))
    return bad(std::string(what) + ": the bias must be empty or (N,) = (" + std::to_string(n) +
               ",) in the output's dtype; it is " + dims_of(bias->dimensions()));
  return ffi::Error::Success();
}

// Rows of x quantized: int8 values and one scale per row.
struct QuantizedRows {
  std::unique_ptr<int8_t[]> q;  // every value written by the quantizer (no zeroing first)
  std::vector<float> scale;
};

// Rows of x quantized on the threads where x has at least kParallelQuantize values, each thread a
// run of rows (each row on its own, so any split gives the same values).
QuantizedRows quantize(ffi::ThreadPool& pool, const ffi::AnyBuffer& x) {
  auto xd = x.dimensions();
  const int64_t m = xd[0], k = xd[1];
  QuantizedRows rows{std::unique_ptr<int8_t[]>(new int8_t[static_cast<size_t>(m * k)]),
                     std::vector<float>(static_cast<size_t>(m))};
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  const char* data = static_cast<const char*>(x.untyped_data());
  const int64_t row_bytes = k * (bf16 ? 2 : 4);
  int8_t* q = rows.q.get();
  float* scale = rows.scale.data();
  if (m == 0) return rows;
  const Runner run_on{&pool, m < 2 || m * k < kParallelQuantize, m * k >= pool_min_values()};
  const int64_t tasks = std::min(m, run_on.threads()), step = (m + tasks - 1) / tasks;
  parallel_tasks(run_on, (m + step - 1) / step, [=](int64_t t) {
    const int64_t r0 = t * step, r1 = std::min(m, r0 + step);
    quantize_rows(data + r0 * row_bytes, bf16, r1 - r0, k, q + r0 * k, scale + r0);
  });
  return rows;
}

// A fused call's float x as a GEMM call's input, its row scales into x_scale (m of them).
GemmInput float_input(const ffi::AnyBuffer& x, std::vector<float>& x_scale) {
  return GemmInput{nullptr, static_cast<const char*>(x.untyped_data()), x.element_type() == ffi::DataType::BF16,
                   x_scale.data()};
}

ffi::Error Int8DenseImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> w_scale,
                         ffi::AnyBuffer bias, std::string_view path_name, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* what = "autopolicy int8 dense";
  const Path* path = path_named(std::string(path_name));
  if (path == nullptr) return unknown_path(what, path_name);
  auto wd = w.dimensions();
  if (x.dimensions().size() != 2 || wd.size() != 2 || wd[0] != x.dimensions()[1])
    return bad(std::string(what) + ": x must be (M, K) and the kernel (K, N); they are " + dims_of(x.dimensions()) +
               " and " + dims_of(wd));
  const int64_t m = x.dimensions()[0], k = wd[0], n = wd[1];
  if (static_cast<int64_t>(w_scale.element_count()) != n)
    return bad(std::string(what) + ": the kernel scale must have N = " + std::to_string(n) + " values; it is " +
               dims_of(w_scale.dimensions()));
  if (ffi::Error e = check_floats(what, x, &bias, out, n); e.failure()) return e;
  const bool bf16 = out->element_type() == ffi::DataType::BF16;
  // A float32 output holds the int32 sums until the rescale overwrites each in place; a bfloat16
  // one takes them in scratch (every sum is written by the product: no zeroing).
  std::unique_ptr<int32_t[]> scratch(bf16 ? new int32_t[static_cast<size_t>(m * n)] : nullptr);
  int32_t* acc = bf16 ? scratch.get() : static_cast<int32_t*>(out->untyped_data());
  const void* b = bias.element_count() ? bias.untyped_data() : nullptr;
  if (gemm_applies(*path, false, m, k, k)) {
    std::vector<float> x_scale(static_cast<size_t>(m));
    const Rescale rescale{x_scale.data(), w_scale.typed_data(), b, bf16, out->untyped_data()};
    const GemmProduct product{w.typed_data(), n, nullptr, acc, &rescale};
    gemm_call(pool, *path, false, float_input(x, x_scale), m, k, k, &product, 1);
    return ffi::Error::Success();
  }
  const QuantizedRows xq = quantize(pool, x);
  const Rescale rescale{xq.scale.data(), w_scale.typed_data(), b, bf16, out->untyped_data()};
  int8_product(pool, *path, xq.q.get(), m, k, w.typed_data(), n, acc, &rescale);
  return ffi::Error::Success();
}

ffi::Error Int4DenseImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> scale,
                         ffi::AnyBuffer bias, int64_t block, std::string_view path_name,
                         ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* what = "autopolicy int4 dense";
  const Path* path = path_named(std::string(path_name));
  if (path == nullptr) return unknown_path(what, path_name);
  if (x.dimensions().size() != 2)
    return bad(std::string(what) + ": x must be (M, K); it is " + dims_of(x.dimensions()));
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], n = w.dimensions().size() == 2 ? w.dimensions()[1] : 0;
  if (ffi::Error e = check_int4(what, k, w.dimensions(), scale.dimensions(), block); e.failure()) return e;
  if (ffi::Error e = check_floats(what, x, &bias, out, n); e.failure()) return e;
  const bool bf16 = out->element_type() == ffi::DataType::BF16;
  std::unique_ptr<float[]> scratch(bf16 ? new float[static_cast<size_t>(m * n)] : nullptr);
  float* y = bf16 ? scratch.get() : static_cast<float*>(out->untyped_data());
  const void* b = bias.element_count() ? bias.untyped_data() : nullptr;
  if (gemm_applies(*path, true, m, k, block)) {
    std::vector<float> x_scale(static_cast<size_t>(m));
    const Rescale rescale{x_scale.data(), nullptr, b, bf16, out->untyped_data()};
    const GemmProduct product{w.typed_data(), n, scale.typed_data(), y, &rescale};
    gemm_call(pool, *path, true, float_input(x, x_scale), m, k, block, &product, 1);
    return ffi::Error::Success();
  }
  const QuantizedRows xq = quantize(pool, x);
  const Rescale rescale{xq.scale.data(), nullptr, b, bf16, out->untyped_data()};
  int4_product(pool, *path, xq.q.get(), m, k, w.typed_data(), n, block, scale.typed_data(), y, &rescale);
  return ffi::Error::Success();
}

// --- the grouped dense calls: several products of one x in one call (a decoder's query, key and
// value projections, or its gate and up), each as its fused dense call computes it, bit for bit.
// One call quantizes x once and hands the threads one set of tasks over every product's columns,
// where separate calls each pay a call's fixed cost and, below serial_max_bytes(), leave the
// other threads idle (SmolLM2's 576 x 192 key and value). On a 2-core Zen 4 EPYC the grouped
// calls ran SmolLM2-135M's int4 q/k/v chain of 24 blocks at 1.05-1.20x the separate calls' speed
// and its decode step at 0.97-1.06x, within that machine's noise (decode steps compiled with
// AUTOPOLICY_GROUPED_PROJECTIONS=1 and =0, timed in alternating order in one process).

// One product of a grouped call: its weights (int8 (K, N) or packed int4 (ceil(K/2), N)), scales
// (int8 (N,), int4 (G, N)), width, output and where its sums go before the rescale (the output
// itself for float32, else scratch).
struct Member {
  const void* w;
  const float* scale;
  int64_t n;
  void* out;
  bool bf16;
  void* sums;
};

// Checks a grouped call's operands (pairs of kernel and scale, one output each) and collects them.
ffi::Error members_of(const char* what, bool int4, const ffi::AnyBuffer& x, const ffi::RemainingArgs& args,
                      const ffi::RemainingRets& rets, int64_t block, std::vector<Member>& members) {
  if (x.dimensions().size() != 2) return bad(std::string(what) + ": x must be (M, K); it is " + dims_of(x.dimensions()));
  const int64_t k = x.dimensions()[1];
  if (rets.size() < 1 || args.size() != 2 * rets.size())
    return bad(std::string(what) + ": needs a kernel and a scale per output; it has " + std::to_string(args.size()) +
               " operands after x and " + std::to_string(rets.size()) + " outputs");
  for (size_t i = 0; i < rets.size(); ++i) {
    auto w = args.get<ffi::AnyBuffer>(2 * i);
    auto scale = args.get<ffi::AnyBuffer>(2 * i + 1);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (w.has_error() || scale.has_error() || out.has_error())
      return bad(std::string(what) + ": operand " + std::to_string(i) + " is not a buffer");
    const std::string which = std::string(what) + " (product " + std::to_string(i) + ")";
    auto wd = w.value().dimensions(), sd = scale.value().dimensions();
    if (w.value().element_type() != (int4 ? ffi::DataType::U8 : ffi::DataType::S8) || wd.size() != 2)
      return bad(which + ": the kernel must be a 2-D " + (int4 ? "uint8 (packed int4)" : "int8") + " array; it is " +
                 dims_of(wd));
    if (scale.value().element_type() != ffi::DataType::F32)
      return bad(which + ": the scale must be float32");
    const int64_t n = wd[1];
    if (int4) {
      if (ffi::Error e = check_int4(which.c_str(), k, wd, sd, block); e.failure()) return e;
    } else {
      if (wd[0] != k) return bad(which + ": the kernel must be (K, N) with K = " + std::to_string(k) + "; it is " + dims_of(wd));
      if (static_cast<int64_t>(scale.value().element_count()) != n)
        return bad(which + ": the kernel scale must have N = " + std::to_string(n) + " values; it is " + dims_of(sd));
    }
    ffi::Result<ffi::AnyBuffer> o = out.value();
    if (ffi::Error e = check_floats(which.c_str(), x, nullptr, o, n); e.failure()) return e;
    members.push_back(Member{w.value().untyped_data(), static_cast<const float*>(scale.value().untyped_data()), n,
                             o->untyped_data(), o->element_type() == ffi::DataType::BF16, nullptr});
  }
  return ffi::Error::Success();
}

ffi::Error GroupedDense(ffi::ThreadPool& pool, const char* what, bool int4, const ffi::AnyBuffer& x,
                        const ffi::RemainingArgs& args, int64_t block, std::string_view path_name,
                        const ffi::RemainingRets& rets) {
  const Path* path = path_named(std::string(path_name));
  if (path == nullptr) return unknown_path(what, path_name);
  std::vector<Member> members;
  if (ffi::Error e = members_of(what, int4, x, args, rets, int4 ? block : 1, members); e.failure()) return e;
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1];
  // bfloat16 outputs take their sums in scratch (int32 or float32, 4 bytes either way).
  int64_t scratch_words = 0, total_n = 0, widest = 0;
  for (const Member& p : members) {
    scratch_words += p.bf16 ? m * p.n : 0;
    total_n += p.n;
    widest = std::max(widest, p.n);
  }
  std::vector<int32_t> scratch(static_cast<size_t>(scratch_words));
  int64_t offset = 0;
  for (Member& p : members) {
    p.sums = p.bf16 ? static_cast<void*>(scratch.data() + offset) : p.out;
    offset += p.bf16 ? m * p.n : 0;
  }
  const int64_t groups = int4 ? (k + block - 1) / block : 1;
  if (gemm_applies(*path, int4, m, k, int4 ? block : k)) {
    // Many rows: every product's tiles as its own call takes them, in one set of tasks.
    std::vector<float> x_scale(static_cast<size_t>(m));
    std::vector<Rescale> rescales;
    std::vector<GemmProduct> products;
    rescales.reserve(members.size());
    for (const Member& p : members) {
      rescales.push_back(Rescale{x_scale.data(), int4 ? nullptr : p.scale, nullptr, p.bf16, p.out});
      products.push_back(GemmProduct{p.w, p.n, int4 ? p.scale : nullptr, p.sums, &rescales.back()});
    }
    gemm_call(pool, *path, int4, float_input(x, x_scale), m, k, int4 ? block : k, products.data(),
              static_cast<int64_t>(products.size()));
    return ffi::Error::Success();
  }
  const QuantizedRows xq = quantize(pool, x);
  const float* xs = xq.scale.data();
  // Few rows: the streaming kernels over column ranges of every product, as many ranges in all as
  // threads (whole 64-column chunks, none across two products), claimed as threads come free;
  // each range is rescaled by the thread that computed it.
  const Runner run_on = runner_for(pool, m * total_n * (int4 ? (k + 1) / 2 : k), m * k);
  const int64_t threads = run_on.threads();
  const int64_t step = threads <= 1 ? widest : std::max<int64_t>(64, ((total_n + threads - 1) / threads + 63) / 64 * 64);
  struct Range {
    int64_t member, n0, n1;
  };
  std::vector<Range> ranges;
  for (size_t i = 0; i < members.size(); ++i)
    for (int64_t n0 = 0; n0 < members[i].n; n0 += step)
      ranges.push_back(Range{static_cast<int64_t>(i), n0, std::min(members[i].n, n0 + step)});
  const Member* mp = members.data();
  const Range* rp = ranges.data();
  const int8_t* xqp = xq.q.get();
  const bool pairs_ok = groups == 1 || block % 2 == 0;
  Int4Fn fn4 = pairs_ok ? path->int4 : int4_portable;
  Int8Fn fn8 = path->int8;
  parallel_tasks(run_on, static_cast<int64_t>(ranges.size()), [=](int64_t t) {
    const Range r = rp[t];
    const Member& p = mp[r.member];
    if (int4) {
      float* y = static_cast<float*>(p.sums);
      fn4(xqp, m, k, static_cast<const uint8_t*>(p.w), p.n, block, p.scale, r.n0, r.n1, y);
      rescale_int4(y, m, p.n, xs, nullptr, p.bf16, r.n0, r.n1, p.out);
    } else {
      int32_t* acc = static_cast<int32_t*>(p.sums);
      fn8(xqp, m, k, static_cast<const int8_t*>(p.w), p.n, r.n0, r.n1, acc);
      rescale_int8(acc, m, p.n, xs, p.scale, nullptr, p.bf16, r.n0, r.n1, p.out);
    }
  });
  return ffi::Error::Success();
}

ffi::Error Int8GroupImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs args, std::string_view path_name,
                         ffi::RemainingRets rets) {
  return GroupedDense(pool, "autopolicy int8 dense group", false, x, args, 1, path_name, rets);
}

ffi::Error Int4GroupImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs args, int64_t block,
                         std::string_view path_name, ffi::RemainingRets rets) {
  return GroupedDense(pool, "autopolicy int4 dense group", true, x, args, block, path_name, rets);
}

}  // namespace
}  // namespace autopolicy_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutopolicyInt8Matmul, autopolicy_cpu::Int8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Attr<std::string_view>("path")
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutopolicyInt4Matmul, autopolicy_cpu::Int4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block")
                                  .Attr<std::string_view>("path")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutopolicyInt8Dense, autopolicy_cpu::Int8DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("path")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutopolicyInt4Dense, autopolicy_cpu::Int4DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("block")
                                  .Attr<std::string_view>("path")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutopolicyInt8DenseGroup, autopolicy_cpu::Int8GroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Attr<std::string_view>("path")
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutopolicyInt4DenseGroup, autopolicy_cpu::Int4GroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("block")
                                  .Attr<std::string_view>("path")
                                  .RemainingRets());

// For ctypes: the path in use, forcing one (tests), and which the CPU supports.
extern "C" {
const char* autopolicy_cpu_path() { return autopolicy_cpu::current_path().name; }
int autopolicy_cpu_set_path(const char* name) { return autopolicy_cpu::set_path(name) ? 1 : 0; }
int autopolicy_cpu_path_supported(const char* name) { return autopolicy_cpu::path_supported(name) ? 1 : 0; }
// 2: the int8 and int4 targets take a "path" attribute (a SIMD path by name; "": the one in use).
// 3: the weight-only target takes it too. 4: the grouped dense targets exist.
int autopolicy_cpu_ffi_version() { return 4; }
int64_t autopolicy_cpu_gemm_min_rows(int int4) { return autopolicy_cpu::gemm_min_rows(int4 != 0); }
void autopolicy_cpu_set_gemm_min_rows(int64_t rows) { autopolicy_cpu::set_gemm_min_rows(rows); }
int64_t autopolicy_cpu_serial_max_bytes() { return autopolicy_cpu::serial_max_bytes(); }
void autopolicy_cpu_set_serial_max_bytes(int64_t bytes) { autopolicy_cpu::set_serial_max_bytes(bytes); }
int64_t autopolicy_cpu_spin_us() { return autopolicy_cpu::spin_us(); }
void autopolicy_cpu_set_spin_us(int64_t us) { autopolicy_cpu::set_spin_us(us); }
int64_t autopolicy_cpu_pool_min_values() { return autopolicy_cpu::pool_min_values(); }
void autopolicy_cpu_set_pool_min_values(int64_t values) { autopolicy_cpu::set_pool_min_values(values); }
int64_t autopolicy_cpu_threads() { return autopolicy_cpu::threads_override(); }
void autopolicy_cpu_set_threads(int64_t threads) { autopolicy_cpu::set_threads_override(threads); }
}
