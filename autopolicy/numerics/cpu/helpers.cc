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
// After fork() a child has none of the parent's threads: a pthread_atfork handler drops the pool
// there, and the child's first call makes a new one (the old one is left, never touched again).
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <system_error>
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

// Pauses (a few microseconds in all) a call polls for its helpers before it yields.
constexpr int kWaitPolls = 256;

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

class Helpers {
 public:
  // Starts up to `count` threads (fewer where the system refuses more: the caller does the rest).
  explicit Helpers(int count) : asked_(count) {
    for (int i = 0; i < count; ++i) {
      try {
        std::thread([this]() { loop(); }).detach();
      } catch (const std::system_error&) {
        break;
      }
      ++count_;
    }
  }

  int count() const { return count_; }
  // Whether the system refused some of the threads asked for (no use asking again for more).
  bool refused() const { return count_ < asked_; }

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

  const int asked_;
  int count_ = 0;
  std::shared_ptr<const std::function<void()>> job_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable wake_;
};

std::mutex g_make;
std::atomic<Helpers*> g_helpers{nullptr};

// In a forked child the helpers' threads are gone (and their mutex may be held): it starts anew.
void forget_helpers_in_child() { g_helpers.store(nullptr); }

Helpers* helpers_for(int wanted) {
  // Never more helpers than the cores but the caller's: a call split for more threads than that
  // (set_threads_override) shares its tasks among those there are, and asks for no new pool.
  static const int most = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) - 1);
  wanted = std::min(wanted, most);
  Helpers* h = g_helpers.load();
  if (h != nullptr && (h->count() >= wanted || h->refused())) return h;
  std::lock_guard<std::mutex> hold(g_make);
  h = g_helpers.load();
  if (h != nullptr && (h->count() >= wanted || h->refused())) return h;
  static const bool registered = pthread_atfork(nullptr, nullptr, forget_helpers_in_child) == 0;
  (void)registered;
  // A new pool (more threads wanted); the old one is never freed: its threads may still hold it.
  h = new Helpers(std::max(wanted, h != nullptr ? h->count() : 0));
  g_helpers.store(h);
  return h;
}

}  // namespace

void wait_until(const std::atomic<int64_t>& count, int64_t target) {
  for (int polls = 0; count.load() < target; ++polls) {
    if (polls < kWaitPolls) {
      relax();
    } else {
      std::this_thread::yield();
    }
  }
}

int64_t spin_us() {
  int64_t v = g_spin_us.load(std::memory_order_relaxed);
  if (v == -2) {
    set_spin_us(env_int("AUTOPOLICY_CPU_SPIN_US", -1));
    v = g_spin_us.load();
  }
  return v;
}

void set_spin_us(int64_t us) { g_spin_us.store(us < 0 ? kSpinUs : us); }

bool offer_to_helpers(int64_t helpers, std::shared_ptr<const std::function<void()>> job) {
  if (helpers <= 0 || spin_us() == 0) return false;
  Helpers* h = helpers_for(static_cast<int>(std::min<int64_t>(helpers, 64)));
  if (h->count() == 0) return false;  // no thread could be started: XLA's pool takes the tasks
  h->publish(std::move(job));
  return true;
}

}  // namespace autopolicy_cpu
