// The package's own helper threads (kernels.h: offer_to_helpers). A decoder calls a kernel for
// every layer, tens of microseconds apart; between two calls the calling thread runs XLA's own
// ops (attention, norms) alone. XLA's pool threads go to sleep in that gap, and waking one took
// 50 us on a 2-core VM (measured: a 576 x 576 int8 layer right after attention ran on the caller
// alone, 65 us where the same call with a pool thread took 22 us). These helpers instead poll
// for the next call for spin_us() microseconds after each one (OpenMP's KMP_BLOCKTIME, llama.cpp's
// polling thread pool) and only then sleep on a condition variable.
//
// A call publishes a job (a shared_ptr, so a helper that arrives late still holds a valid one)
// and bumps an epoch; each helper runs each job it sees once. Jobs claim their tasks from a
// counter (ffi.cc's parallel_tasks), so a helper that runs a job late, twice or never changes
// nothing but who does the work: the caller takes every task no helper has claimed, and waits
// only for claimed ones. Two callers at once (XLA running two kernels side by side) may replace
// each other's job; each still finishes its own tasks.
//
// After fork() a child has none of the parent's threads: the pool is made anew in a process
// whose id differs from its maker's (the old one is left, never touched again).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace autopolicy_cpu {
namespace {

// Polling time after each job (microseconds): longer than the gaps between a decoder's layer
// calls (the attention between two projections: about 110 us on the 2-core VM).
constexpr int64_t kSpinUs = 500;

std::atomic<int64_t> g_spin_us{-2};  // -2: not read yet

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

class Helpers {
 public:
  explicit Helpers(int count) : pid_(getpid()), count_(count) {
    for (int i = 0; i < count; ++i) std::thread([this]() { loop(); }).detach();
  }

  int count() const { return count_; }
  pid_t pid() const { return pid_; }

  void publish(std::shared_ptr<const std::function<void()>> job) {
    std::atomic_store(&job_, std::move(job));
    epoch_.fetch_add(1);
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> hold(mu_); }
      wake_.notify_all();
    }
  }

 private:
  void loop() {
    uint64_t seen = epoch_.load();
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
      int polls = 0;
      while (epoch_.load() == seen) {
        relax();
        // Every so often: the clock, and the core for any other thread that wants it.
        if (++polls % 64 == 0) {
          if (std::chrono::steady_clock::now() >= until) {
            std::unique_lock<std::mutex> hold(mu_);
            sleepers_.fetch_add(1);
            wake_.wait(hold, [&]() { return epoch_.load() != seen; });
            sleepers_.fetch_sub(1);
            break;
          }
          std::this_thread::yield();
        }
      }
      seen = epoch_.load();
      const std::shared_ptr<const std::function<void()>> job = std::atomic_load(&job_);
      if (job) (*job)();
    }
  }

  const pid_t pid_;
  const int count_;
  std::shared_ptr<const std::function<void()>> job_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable wake_;
};

std::mutex g_make;
std::atomic<Helpers*> g_helpers{nullptr};

Helpers* helpers_for(int wanted) {
  Helpers* h = g_helpers.load();
  if (h != nullptr && h->pid() == getpid() && h->count() >= wanted) return h;
  std::lock_guard<std::mutex> hold(g_make);
  h = g_helpers.load();
  if (h != nullptr && h->pid() == getpid() && h->count() >= wanted) return h;
  // A new pool (more threads wanted, or a forked child); the old one is never freed: its threads
  // may still hold it.
  const int most = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) - 1);
  h = new Helpers(std::min(std::max(wanted, h != nullptr && h->pid() == getpid() ? h->count() : 0), most));
  g_helpers.store(h);
  return h;
}

}  // namespace

int64_t spin_us() {
  int64_t v = g_spin_us.load(std::memory_order_relaxed);
  if (v == -2) {
    const char* forced = std::getenv("AUTOPOLICY_CPU_SPIN_US");
    set_spin_us(forced != nullptr && *forced != '\0' ? std::atoll(forced) : -1);
    v = g_spin_us.load();
  }
  return v;
}

void set_spin_us(int64_t us) { g_spin_us.store(us < 0 ? kSpinUs : us); }

bool offer_to_helpers(int64_t helpers, std::shared_ptr<const std::function<void()>> job) {
  if (helpers <= 0 || spin_us() == 0) return false;
  Helpers* h = helpers_for(static_cast<int>(std::min<int64_t>(helpers, 64)));
  h->publish(std::move(job));
  return true;
}

}  // namespace autopolicy_cpu
