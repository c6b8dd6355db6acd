// The XLA FFI binding of the weight-only product (weight_only.h): checks shapes (naming the bad
// operand) and g_idx, sums x over each group once, and runs the kernel of the SIMD path the call
// names (its "path" attribute; "": the one in use) over the output rows (weight_only_any_groups
// where g_idx is not k / group: GPTQ's act-order), split over as many threads as XLA's intra-op
// pool has (the package's polling helpers, helpers.cc, or XLA's pool with
// AUTOPOLICY_CPU_SPIN_US=0) when the weights are large enough to repay the hand-off (smaller
// products stay on the calling thread). No state across calls.
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "weight_only.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace autopolicy_cpu {

WeightOnlyFn weight_only_kernel() { return current_path().weight_only; }

namespace {

// Output rows per task (even: a packed byte row is never split).
constexpr int64_t kRowsPerTask = 64;

ffi::Error invalid(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "autopolicy weight-only matmul: " + what);
}

std::string dims(int64_t a, int64_t b) { return "(" + std::to_string(a) + ", " + std::to_string(b) + ")"; }

ffi::Error WeightOnlyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                          ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::U8> zero, ffi::Buffer<ffi::F32> g_idx,
                          int64_t bits, int64_t group, std::string_view path_name, ffi::ResultBuffer<ffi::F32> out) {
  // The SIMD path the call names ("": the one in use): on a Zen 4, whose AVX-512 runs as two
  // 256-bit halves, the AVX2 kernel ran a SmolLM2-135M gptq/8 decode step at 2.99-3.11x float32,
  // the AVX-512 one at 1.91-1.95x (benchmarks/smollm2_cpu_paths.py), so both are tactics.
  const Path* path = path_named(std::string(path_name));
  if (path == nullptr) return invalid(path_refusal(std::string(path_name)));
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), zd = zero.dimensions();
  auto gd = g_idx.dimensions();
  if (xd.size() != 2) return invalid("x must be (M, K); its rank is " + std::to_string(xd.size()));
  if (bits != 4 && bits != 8) return invalid("bits must be 4 (packed) or 8 (a byte each); got " + std::to_string(bits));
  const int64_t m = xd[0], k = xd[1];
  if (group < 1 || group > std::max<int64_t>(k, 1))
    return invalid("group must be in [1, K] with K = " + std::to_string(k) + "; got " + std::to_string(group));
  if (sd.size() != 2) return invalid("the scale must be (N, G); its rank is " + std::to_string(sd.size()));
  const int64_t n = sd[0], groups = (k + group - 1) / group;
  if (sd[1] != groups) return invalid("the scale must be (N, G) with G = " + std::to_string(groups));
  if (zd.size() != 2 || zd[0] != n || zd[1] != groups) return invalid("the zero point must be " + dims(n, groups));
  const int64_t rows = bits == 4 ? (n + 1) / 2 : n;
  if (qd.size() != 2 || qd[0] != rows || qd[1] != k) return invalid("the kernel must be " + dims(rows, k));
  if (gd.size() != 1 || gd[0] != k) return invalid("g_idx must be (K,) with K = " + std::to_string(k));
  // g_idx holds group numbers as floats (Keras's dtype): each must be a whole number in [0, G).
  // The check runs at every call, so it is kept cheap: first whether g_idx is k / group (one
  // comparison an input, no division: with a 64-bit division an input, a call at K = 576, N = 8
  // took 12 us, now 8, on a Zen 3 EPYC); only otherwise (act-order) each entry's group is read
  // and checked.
  const float* gp = g_idx.typed_data();
  bool consecutive = true;
  for (int64_t g = 0; g < groups && consecutive; ++g) {
    const float expected = static_cast<float>(g);
    for (int64_t i = g * group; i < std::min(k, (g + 1) * group); ++i) consecutive &= gp[i] == expected;
  }
  std::vector<int32_t> group_of;
  if (!consecutive) {
    group_of.resize(static_cast<size_t>(k));
    const float last = static_cast<float>(groups);
    for (int64_t i = 0; i < k; ++i) {
      const float v = gp[i];
      const int32_t whole = v >= 0.0f && v < last ? static_cast<int32_t>(v) : -1;
      if (whole < 0 || v != static_cast<float>(whole))
        return invalid("g_idx[" + std::to_string(i) + "] = " + std::to_string(v) + " is not a group in [0, " +
                       std::to_string(groups) + ")");
      group_of[i] = whole;
    }
  }
  if (m == 0 || n == 0) return ffi::Error::Success();

  // x summed over each group, in eight interleaved partial sums (one running sum is a chain of
  // dependent additions: about 1 us at K = 576).
  std::vector<float> xsum(static_cast<size_t>(m * groups));
  const float* xp = x.typed_data();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* row = xp + r * k;
      const int64_t i0 = g * group, i1 = std::min(k, (g + 1) * group);
      float part[8] = {};
      int64_t i = i0;
      for (; i + 8 <= i1; i += 8)
        for (int j = 0; j < 8; ++j) part[j] += row[i + j];
      for (int j = 0; i < i1; ++i, ++j) part[j] += row[i];
      xsum[r * groups + g] = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    }
  const WeightOnlyArgs args{xp, m, k, q.typed_data(), n, bits, group, scale.typed_data(), zero.typed_data(),
                            xsum.data(), out->typed_data()};
  const int32_t* groups_of = group_of.data();
  const WeightOnlyFn fast = path->weight_only;
  auto kernel = [consecutive, fast, groups_of](const WeightOnlyArgs& a, int64_t n0, int64_t n1) {
    if (consecutive) {
      fast(a, n0, n1);
    } else {
      weight_only_any_groups(a, groups_of, n0, n1);
    }
  };
  // One row of x streams the weights front to back (weight_only_avx2.cc): a task is then a long
  // run of rows (about four a thread), so each thread's stream is rarely broken; more rows of x
  // reuse each task's weights from the caches, and short tasks balance the threads better.
  const int64_t pool_threads = call_threads(pool.num_threads());
  const int64_t per_task = m == 1 ? std::max<int64_t>(kRowsPerTask, (n / (4 * pool_threads)) / kRowsPerTask * kRowsPerTask)
                                  : kRowsPerTask;
  const int64_t parts = (n + per_task - 1) / per_task;
  const int64_t threads = std::min<int64_t>(parts, pool_threads);
  // Small calls stay on the calling thread (serial_max_bytes(), shared with the integer kernels).
  if (m * rows * k <= serial_max_bytes() || threads <= 1) {
    kernel(args, 0, n);
    return ffi::Error::Success();
  }
  share_tasks(pool, parts, threads, [args, kernel, n, per_task](int64_t p) {
    kernel(args, p * per_task, std::min(n, (p + 1) * per_task));
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace autopolicy_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(AutopolicyWeightOnlyMatmul, autopolicy_cpu::WeightOnlyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<std::string_view>("path")
                                  .Ret<ffi::Buffer<ffi::F32>>());

// For ctypes: the variant of the weight-only kernel the current path runs.
extern "C" const char* autopolicy_cpu_weight_only_variant() {
#if defined(__x86_64__)
  const autopolicy_cpu::WeightOnlyFn fn = autopolicy_cpu::weight_only_kernel();
  if (fn == autopolicy_cpu::weight_only_avx512) return "avx512";
  if (fn == autopolicy_cpu::weight_only_avx2) return "avx2";
#endif
  return "portable";
}
