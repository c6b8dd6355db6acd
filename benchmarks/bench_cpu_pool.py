"""Who takes a CPU-kernel call's other shares at many rows: the kernels' own polling helpers or
XLA's intra-op pool (``cpu_kernels.pool_min_values``), timed as the search times a layer.

Each layer runs in the search's timing loop (:func:`autopolicy.search.timing.compile_loop`),
where every call's input is made by a fusion XLA splits over its pool, as a model's norms and
activations between its projections are. Per shape, every round times in a fresh random order:
float32 XLA's dot, and the fused int8 and int4 (per channel) calls three ways: with the helpers
only (``pool_min_values`` out of reach), with XLA's pool only (0), and with the default (the
pool from an x of ``pool_min_values()`` values). Prints each one's ratio to float32 and the
default's speed over the helpers' (medians over rounds of paired ratios, with quartiles).

    python benchmarks/bench_cpu_pool.py                       # the shapes below, 31 rounds
    python benchmarks/bench_cpu_pool.py --shapes 256x576x192 --rounds 61
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu_kernels import BASELINE, candidates, dims  # noqa: E402
from bench_kernels import device_lines  # noqa: E402

from autopolicy.numerics import cpu_kernels  # noqa: E402
from autopolicy.numerics.device import current_device, read_cpuinfo  # noqa: E402
from autopolicy.search import timing  # noqa: E402

SHAPES = ((256, 576, 192), (256, 576, 576), (256, 576, 1536), (256, 1536, 576), (256, 1024, 1024), (512, 384, 384),
          (128, 384, 1536), (64, 576, 1536), (32, 576, 576))
MODES = {"helpers": 1 << 62, "pool": 0, "default": None}
KERNELS = ("int8 ffi", "int4 ffi")


def _shape(text: str) -> tuple[int, int, int]:
    """``(M, K, N)`` of an ``MxKxN`` shape argument, e.g. ``256x576x192``."""
    return dims(text, "MKN", "256x576x192")


def bench(m: int, k: int, n: int, rounds: int, seed: int = 0, target: float = 0.02) -> dict[tuple[str, str], np.ndarray]:
    """``{(candidate, mode): seconds per call in each round}``; float32's mode is "default"."""
    cands, _ = candidates(m, k, n, seed, keras=False)
    runners = {}
    for name in (BASELINE,) + KERNELS:
        loop = timing.compile_loop(cands[name])
        loop(2)
        start = time.perf_counter()
        loop(5)
        reps = max(3, int(target / max((time.perf_counter() - start) / 5, 1e-7)))
        for mode in MODES if name != BASELINE else ("default",):
            def run(loop=loop, mode=mode, reps=reps):
                cpu_kernels.set_pool_min_values(MODES[mode])
                loop(2)  # the threads as this mode leaves them
                start = time.perf_counter()
                loop(reps)
                return (time.perf_counter() - start) / reps
            runners[(name, mode)] = run
    times = {key: [] for key in runners}
    rng = np.random.default_rng(seed)
    keys = list(runners)
    try:
        for _ in range(rounds):
            for i in rng.permutation(len(keys)):
                times[keys[i]].append(runners[keys[i]]())
    finally:
        cpu_kernels.set_pool_min_values(None)
    return {key: np.asarray(v) for key, v in times.items()}


def line(m: int, k: int, n: int, times: dict[tuple[str, str], np.ndarray]) -> str:
    base = times[(BASELINE, "default")]
    cells = []
    for name in KERNELS:
        ratios = ", ".join(f"{mode} {np.median(base / times[(name, mode)]):.2f}x" for mode in MODES)
        speed = times[(name, "helpers")] / times[(name, "default")]
        cells.append(f"{name}: {ratios}; default over helpers {np.median(speed):.2f}x "
                     f"[{np.percentile(speed, 25):.2f}-{np.percentile(speed, 75):.2f}]")
    return f"{m}x{k}x{n} (x {m * k} values): float32 {np.median(base) * 1e6:.0f} us | " + " | ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=_shape, default=list(SHAPES), help="M x K x N, e.g. 256x576x192")
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args(argv)
    if not cpu_kernels.AVAILABLE:
        print(f"the CPU kernels are not available here: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    cpu_model, _ = read_cpuinfo()
    for text in device_lines(current_device(), cpu_model):
        print(text)
    print(f"- CPU kernel path: `{cpu_kernels.path()}`; pool_min_values: {cpu_kernels.pool_min_values()}")
    for m, k, n in args.shapes:
        print(line(m, k, n, bench(m, k, n, args.rounds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
