// The XLA FFI binding: checks shapes and dtypes (naming the bad one), splits the output columns
// over XLA's own intra-op thread pool (the caller takes its share too), and runs the current
// path's kernel. No state across calls.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace autopolicy_cpu {
namespace {

constexpr int64_t kColumnsPerTask = 64;
// The int8 product of few rows (at most kSlabMaxRows) splits K into up to kSlabs slabs of at
// least kSlabRows rows.
constexpr int64_t kSlabs = 8, kSlabRows = 256, kSlabMaxRows = 4;

// Runs body(t) for t in [0, tasks), on the pool and the calling thread. The caller never waits
// for a task that has not started: tasks are claimed from a counter, and the caller waits only
// for claimed tasks to finish.
template <typename Body>
void parallel_tasks(ffi::ThreadPool& pool, int64_t tasks, Body body) {
  if (tasks <= 1) {
    if (tasks == 1) body(0);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto run = [state, tasks, body]() {
    for (int64_t t; (t = state->next.fetch_add(1)) < tasks;) {
      body(t);
      state->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(tasks, std::max<int64_t>(1, pool.num_threads())) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([run]() { run(); });
  run();
  while (state->done.load() < tasks) std::this_thread::yield();
}

// Runs body(n0, n1) over [0, n) in one chunk per thread.
template <typename Body>
void parallel_columns(ffi::ThreadPool& pool, int64_t n, int64_t min_chunk, Body body) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t chunks = std::min<int64_t>(threads, std::max<int64_t>(1, n / min_chunk));
  if (chunks <= 1) {
    body(0, n);
    return;
  }
  int64_t step = (n + chunks - 1) / chunks;
  step = (step + 31) / 32 * 32;  // whole SIMD chunks (32 columns: the int4 kernel's)
  chunks = (n + step - 1) / step;
  parallel_tasks(pool, chunks, [=](int64_t c) { body(c * step, std::min(n, (c + 1) * step)); });
}

// The GEMM's tasks: blocks of at most kGemmCols columns (whole strips) times blocks of rows (whole
// panels), at least two per thread where the shape allows (the machine is shared: a thread that
// runs late then delays the call by less than its whole share). body(r0, r1, n0, n1).
template <typename Body>
void parallel_tiles(ffi::ThreadPool& pool, int64_t m, int64_t n, Body body) {
  if (m <= 0 || n <= 0) return;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t want = 2 * threads;
  int64_t strips = (n + kGemmStrip - 1) / kGemmStrip;
  int64_t col_tasks = (n + kGemmCols - 1) / kGemmCols;
  if (col_tasks < want) col_tasks = std::min(strips, want);
  const int64_t col_step = (strips + col_tasks - 1) / col_tasks * kGemmStrip;
  col_tasks = (n + col_step - 1) / col_step;
  const int64_t panels = (m + kGemmRows - 1) / kGemmRows;
  int64_t row_tasks = std::min(panels, std::max<int64_t>(1, (want + col_tasks - 1) / col_tasks));
  row_tasks = std::max(row_tasks, (panels + 47) / 48);  // at most 192 rows a task: x's chunk stays in L2
  const int64_t row_step = (panels + row_tasks - 1) / row_tasks * kGemmRows;
  row_tasks = (m + row_step - 1) / row_step;
  parallel_tasks(pool, row_tasks * col_tasks, [=](int64_t t) {
    const int64_t r = t / col_tasks, c = t % col_tasks;
    body(r * row_step, std::min(m, (r + 1) * row_step), c * col_step, std::min(n, (c + 1) * col_step));
  });
}

ffi::Error bad(const std::string& what) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, what); }

ffi::Error Int8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                    ffi::ResultBuffer<ffi::S32> acc) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2) return bad("autopolicy int8 matmul: x must be (M, K); its rank is " + std::to_string(xd.size()));
  if (wd.size() != 2 || wd[0] != xd[1])
    return bad("autopolicy int8 matmul: the kernel must be (K, N) with K = " + std::to_string(xd[1]));
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  const Path& path = current_path();
  const int8_t* xp = x.typed_data();
  const int8_t* wp = w.typed_data();
  int32_t* out = acc->typed_data();
  if (path.int8_gemm != nullptr && m >= gemm_min_rows(false) && k > 0) {
    std::vector<int32_t> xq(static_cast<size_t>((m + kGemmRows - 1) / kGemmRows * kGemmRows * ((k + 1) / 2)));
    pack_x_pairs(xp, m, k, xq.data());
    const int32_t* a = xq.data();
    Int8GemmFn gemm = path.int8_gemm;
    parallel_tiles(pool, m, n, [=](int64_t r0, int64_t r1, int64_t n0, int64_t n1) {
      gemm(a, m, k, wp, n, r0, r1, n0, n1, out);
    });
    return ffi::Error::Success();
  }
  const int64_t slabs = std::min<int64_t>(kSlabs, k / kSlabRows);
  if (m <= kSlabMaxRows && slabs > 1 && n >= 16) {
    // Few rows: slabs of K rows, each a contiguous stretch of the weights (one stream the
    // prefetchers follow, where a column split reads pieces of every row), claimed by the
    // threads as they come free; each slab's int32 sums are added at the end (exact).
    const int64_t step = (k / slabs + 3) / 4 * 4;
    const int64_t count = (k + step - 1) / step;
    std::vector<int32_t> partial(static_cast<size_t>((count - 1) * m * n));
    std::vector<int8_t> xs(static_cast<size_t>(count * m * step));
    for (int64_t s = 0; s < count; ++s)
      for (int64_t r = 0; r < m; ++r) {
        const int64_t k0 = s * step, k1 = std::min(k, k0 + step);
        std::copy(xp + r * k + k0, xp + r * k + k1, xs.data() + (s * m + r) * step);
      }
    int32_t* parts = partial.data();
    const int8_t* xsp = xs.data();
    parallel_tasks(pool, count, [=](int64_t s) {
      const int64_t k0 = s * step, k1 = std::min(k, k0 + step);
      const int8_t* xsub = xsp + s * m * step;
      int32_t* dst = s == 0 ? out : parts + (s - 1) * m * n;
      if (k1 - k0 == step) {
        path.int8(xsub, m, k1 - k0, wp + k0 * n, n, 0, n, dst);
      } else {  // the last slab: its rows of x repacked to its own width
        std::vector<int8_t> x_last(static_cast<size_t>(m * (k1 - k0)));
        for (int64_t r = 0; r < m; ++r) std::copy(xsub + r * step, xsub + r * step + (k1 - k0), x_last.data() + r * (k1 - k0));
        path.int8(x_last.data(), m, k1 - k0, wp + k0 * n, n, 0, n, dst);
      }
    });
    for (int64_t s = 1; s < count; ++s) {
      const int32_t* src = parts + (s - 1) * m * n;
      for (int64_t i = 0; i < m * n; ++i) out[i] += src[i];
    }
    return ffi::Error::Success();
  }
  parallel_columns(pool, n, kColumnsPerTask, [=](int64_t n0, int64_t n1) { path.int8(xp, m, k, wp, n, n0, n1, out); });
  return ffi::Error::Success();
}

ffi::Error Int4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> scale,
                    int64_t block, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2) return bad("autopolicy int4 matmul: x must be (M, K); its rank is " + std::to_string(xd.size()));
  const int64_t m = xd[0], k = xd[1];
  if (wd.size() != 2 || wd[0] != (k + 1) / 2)
    return bad("autopolicy int4 matmul: the packed kernel must be (ceil(K/2), N) with K = " + std::to_string(k));
  if (block <= 0 || block > k) return bad("autopolicy int4 matmul: block must be in [1, K]; got " + std::to_string(block));
  const int64_t n = wd[1];
  const int64_t groups = (k + block - 1) / block;
  if (sd.size() != 2 || sd[0] != groups || sd[1] != n)
    return bad("autopolicy int4 matmul: the scale must be (G, N) = (" + std::to_string(groups) + ", " + std::to_string(n) + ")");
  // SIMD paths take rows in pairs (2j, 2j + 1): a pair must not straddle a block.
  const bool pairs_ok = groups == 1 || block % 2 == 0;
  const Path& path = current_path();
  Int4Fn fn = pairs_ok ? path.int4 : int4_portable;
  const int8_t* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  const float* sp = scale.typed_data();
  float* yp = out->typed_data();
  if (pairs_ok && path.int4_gemm != nullptr && m >= gemm_min_rows(true)) {
    std::vector<int32_t> xq(static_cast<size_t>((m + kGemmRows - 1) / kGemmRows * kGemmRows * ((k + 1) / 2)));
    pack_x_pairs(xp, m, k, xq.data());
    const int32_t* a = xq.data();
    Int4GemmFn gemm = path.int4_gemm;
    parallel_tiles(pool, m, n, [=](int64_t r0, int64_t r1, int64_t n0, int64_t n1) {
      gemm(a, m, k, wp, n, block, sp, r0, r1, n0, n1, yp);
    });
    return ffi::Error::Success();
  }
  parallel_columns(pool, n, kColumnsPerTask, [=](int64_t n0, int64_t n1) { fn(xp, m, k, wp, n, block, sp, n0, n1, yp); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace autopolicy_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutopolicyInt8Matmul, autopolicy_cpu::Int8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutopolicyInt4Matmul, autopolicy_cpu::Int4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// For ctypes: the path in use, forcing one (tests), and which the CPU supports.
extern "C" {
const char* autopolicy_cpu_path() { return autopolicy_cpu::current_path().name; }
int autopolicy_cpu_set_path(const char* name) { return autopolicy_cpu::set_path(name) ? 1 : 0; }
int autopolicy_cpu_path_supported(const char* name) { return autopolicy_cpu::path_supported(name) ? 1 : 0; }
int64_t autopolicy_cpu_gemm_min_rows(int int4) { return autopolicy_cpu::gemm_min_rows(int4 != 0); }
void autopolicy_cpu_set_gemm_min_rows(int64_t rows) { autopolicy_cpu::set_gemm_min_rows(rows); }
}
