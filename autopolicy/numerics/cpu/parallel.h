// Splitting an FFI call's work over threads, shared by the FFI bindings (ffi.cc,
// ffi_weight_only.cc, attention.cc).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "kernels.h"
#include "xla/ffi/api/ffi.h"

namespace autopolicy_cpu {

// Runs body(t) for t in [0, tasks) on the calling thread and up to threads - 1 others: the
// package's polling helpers (helpers.cc), or XLA's intra-op pool where those are off
// (AUTOPOLICY_CPU_SPIN_US=0) or `xla_pool` asks for it (pool_min_values). Tasks are claimed
// from a counter, so the caller never waits for a task that has not started: it takes every task
// no other thread has claimed, and waits only for the claimed ones to finish. threads <= 1 (or
// one task): all on the calling thread.
//
// Tasks [0, first) are a first phase: each finishes before any later task starts. They are
// claimed first, so a thread that claims a later one waits only for first-phase tasks already
// running. Two phases in one region wake the other threads once, and they wake while the first
// phase runs (a GEMM's x quantized and packed, then its tiles).
template <typename Body>
void share_tasks(xla::ffi::ThreadPool& pool, int64_t tasks, int64_t threads, Body body, bool xla_pool = false,
                 int64_t first = 0) {
  if (tasks <= 1 || threads <= 1) {
    for (int64_t t = 0; t < tasks; ++t) body(t);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<int64_t> first_done{0};
  };
  auto state = std::make_shared<State>();
  auto run = [state, tasks, first, body]() {
    for (int64_t t; (t = state->next.fetch_add(1)) < tasks;) {
      if (t >= first && first > 0) wait_until(state->first_done, first);
      body(t);
      if (t < first) state->first_done.fetch_add(1);
      state->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min(tasks, threads) - 1;
  if (xla_pool || !offer_to_helpers(helpers, std::make_shared<const std::function<void()>>(run)))
    for (int64_t t = 0; t < helpers; ++t) pool.Schedule([run]() { run(); });
  run();
  wait_until(state->done, tasks);
}

}  // namespace autopolicy_cpu
