"""What reading a layer's weights costs on this machine, and nothing else: the ceiling that a
batch-1 kernel's speed-up over float32 meets when only the reads remain.

A small C++ program (compiled here at run time: ``$CXX`` or g++, ``-O3 -march=native``) reads
copies of a region in turn, as ``bench_cpu_kernels.py``'s batch-1 chains cycle through copies of
a layer's weights (the same number of copies: about ``max(64 MB, twice the largest cache)`` of
them, at most 64). Each call's bytes are split between the calling thread and one helper that
polls for the next call, as the package's own helpers do (``helpers.cc``); ``--threads 1`` reads
on the caller alone. For each shape the program reads as many bytes as the layer's float32, int8
and int4 weights, one after another, in each of ``--runs`` runs. It prints each read's median time
per call and the ratios float32/int8 and float32/int4 within each run.

Nothing here runs XLA or the package's kernels: the figures say how fast the bytes can arrive,
not how fast any kernel goes. Put them beside ``bench_cpu_kernels.py --batches 1`` run on the
same machine (``reports/cpu-kernels-amd-epyc-avx2-2c.md``, "What reading the bytes costs").

Usage::

    python benchmarks/read_ceiling.py                                  # the benchmark's shapes
    python benchmarks/read_ceiling.py --shapes 576x1536 --runs 5 --threads 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu_kernels import SHAPES, _cache_bytes, _copies, _shape  # noqa: E402

from autopolicy.search import hardware  # noqa: E402

_SOURCE = r"""
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

static std::atomic<long> epoch{0}, done{0};
static std::atomic<const uint64_t*> region{nullptr};
static long first_words = 0, all_words = 0;
static std::atomic<uint64_t> sink{0}, helper_sum{0};

// A sum of the words, in four independent chains (the compiler makes vector loads of it).
static uint64_t read_words(const uint64_t* p, long n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  long i = 0;
  for (; i + 4 <= n; i += 4) { a += p[i]; b += p[i + 1]; c += p[i + 2]; d += p[i + 3]; }
  for (; i < n; ++i) a += p[i];
  return a + b + c + d;
}

int main(int argc, char** argv) {
  if (argc != 6) { std::fprintf(stderr, "usage: read BYTES COPIES THREADS CALLS REPEATS\n"); return 2; }
  const long bytes = std::atol(argv[1]), copies = std::atol(argv[2]), threads = std::atol(argv[3]);
  const long calls = std::atol(argv[4]), repeats = std::atol(argv[5]);
  all_words = std::max(1L, bytes / 8);
  first_words = threads == 2 ? all_words / 2 : all_words;
  std::vector<uint64_t*> copy(copies);
  for (long c = 0; c < copies; ++c) {
    copy[c] = static_cast<uint64_t*>(std::aligned_alloc(64, (all_words * 8 + 63) / 64 * 64));
    for (long i = 0; i < all_words; ++i) copy[c][i] = static_cast<uint64_t>(c * 7 + i);
  }
  std::thread helper;
  if (threads == 2)
    helper = std::thread([] {
      long seen = 0;
      for (;;) {
        long now;
        while ((now = epoch.load()) == seen) {}
        if (now < 0) return;
        seen = now;
        helper_sum.store(read_words(region.load() + first_words, all_words - first_words));
        done.fetch_add(1);
      }
    });
  std::vector<double> per_call;
  // One call: the sum of every word of the copy, the caller's part and the helper's.
  auto call = [&](const uint64_t* p) -> uint64_t {
    if (threads != 2) return read_words(p, all_words);
    const long before = done.load();
    region.store(p);
    epoch.fetch_add(1);
    const uint64_t mine = read_words(p, first_words);
    while (done.load() == before) {}
    return mine + helper_sum.load();
  };
  for (long r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (long i = 0; i < calls; ++i) sink += call(copy[i % copies]);
    per_call.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / calls);
  }
  const uint64_t checksum = call(copy[0]);
  if (threads == 2) { epoch.store(-1); helper.join(); }
  std::sort(per_call.begin(), per_call.end());
  // The median time per call, and the words' sum in copy 0 (the caller's check that all were read).
  std::printf("%.3f %llu\n", per_call[per_call.size() / 2], static_cast<unsigned long long>(checksum));
  return 0;
}
"""


def compiler() -> str | None:
    """The C++ compiler the reader is built with: ``$CXX``, else g++ or c++ on PATH (None: none)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(workdir: str) -> str:
    """Compiles the reader into ``workdir``; its path."""
    compiler_path = compiler()
    if compiler_path is None:
        raise SystemExit("read_ceiling.py needs a C++ compiler: set CXX or install g++ (none was found on PATH)")
    source, binary = os.path.join(workdir, "read.cc"), os.path.join(workdir, "read")
    with open(source, "w", encoding="utf-8") as f:
        f.write(_SOURCE)
    subprocess.run([compiler_path, "-O3", "-march=native", "-std=c++17", "-pthread", source, "-o", binary], check=True)
    return binary


def read_us(binary: str, nbytes: int, copies: int, threads: int, calls: int, repeats: int) -> tuple[float, int]:
    """Median microseconds per call for reading ``nbytes`` (one copy of ``copies`` per call; the
    last ``nbytes % 8`` bytes are left out), and the sum of copy 0's 64-bit words as read (word
    i of copy 0 holds i: ``w * (w - 1) / 2`` for ``w`` words)."""
    out = subprocess.run([binary, str(nbytes), str(copies), str(threads), str(calls), str(repeats)],
                         check=True, capture_output=True, text=True).stdout
    median, checksum = out.split()
    return float(median), int(checksum)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=_shape, default=list(SHAPES), help="K x N, e.g. 576x1536")
    parser.add_argument("--runs", type=int, default=3, help="runs, each reading float32, int8, int4 in turn")
    parser.add_argument("--threads", type=int, choices=(1, 2), default=2,
                        help="2: the caller and one polling helper, each half of the bytes; 1: the caller alone")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions a read (the median is kept)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.repeats < 1:
        parser.error(f"--runs and --repeats must be >= 1; got {args.runs} and {args.repeats}")
    budget = max(64 << 20, 2 * _cache_bytes())
    print(hardware.describe())
    print(f"threads: {args.threads}; copies: as bench_cpu_kernels.py's chains ({budget >> 20} MB of them, at most 64)")
    with tempfile.TemporaryDirectory() as workdir:
        binary = build(workdir)
        for k, n in args.shapes:
            sizes = {"float32": 4 * k * n, "int8": k * n, "int4": -(-k // 2) * n}
            times = {name: [] for name in sizes}
            for _ in range(args.runs):
                for name, nbytes in sizes.items():
                    copies = _copies(nbytes, budget)
                    calls = max(64, int(2e8 // max(1, nbytes)) // copies * copies)  # about 200 MB a repetition
                    times[name].append(read_us(binary, nbytes, copies, args.threads, calls, args.repeats)[0])
            ratios = {name: [f / t for f, t in zip(times["float32"], times[name])] for name in ("int8", "int4")}
            cached = [name for name, nbytes in sizes.items() if _copies(nbytes, budget) * nbytes < budget]
            print(f"{k}x{n}: " + ", ".join(
                f"{name} {statistics.median(t):.1f} us ({sizes[name] / statistics.median(t) / 1e3:.1f} GB/s)"
                for name, t in times.items())
                + " | float32/int8 " + f"{min(ratios['int8']):.2f}-{max(ratios['int8']):.2f}x"
                + ", float32/int4 " + f"{min(ratios['int4']):.2f}-{max(ratios['int4']):.2f}x"
                + (f" (copies partly cached: {', '.join(cached)})" if cached else ""))


if __name__ == "__main__":
    main()
