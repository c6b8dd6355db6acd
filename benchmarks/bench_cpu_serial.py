"""Where splitting one CPU-kernel call over XLA's thread pool starts to pay: each layer shape at
batch 1 timed with every call on the calling thread (serial) and with every call split over the
pool, side by side (interleaved rounds), as a model runs them: a jitted chain of calls, each on
its own copy of the weights (about 48 MB in all, more than the L3 cache, so the weights stream
from memory as a decoder's do), each input depending on the output before.

    .venv/bin/python benchmarks/bench_cpu_serial.py [--shapes 576x192 ...] [--rounds 9]

Prints per shape and kernel (fused int8_dense, int4_dense per channel) the microseconds per call
both ways and the ratio; cpu_kernels.serial_max_bytes() should sit where the ratio crosses 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.numerics import cpu_kernels, int4, int8

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu_kernels import next_input  # noqa: E402

SHAPES = ["576x192", "576x576", "576x1536", "1536x576", "2048x2048", "4096x4096"]


def _program(layer, copies):
    def run(x, weights):
        y, x0 = None, x
        for w in weights:
            y = layer(x, *w)
            x = next_input(x0, y)  # no chain of adds for XLA to recompute (see there)
        return y
    return jax.jit(run)


def bench(k: int, n: int, rounds: int, budget: float = 48e6) -> list[str]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, k)).astype(np.float32))
    lines = []
    for kind, nbytes in (("int8", k * n), ("int4", (k + 1) // 2 * n)):
        copies = int(max(2, min(96, budget // nbytes)))
        weights = []
        for c in range(copies):
            w = jnp.asarray(np.random.default_rng(c).standard_normal((k, n)).astype(np.float32))
            if kind == "int8":
                weights.append(int8.quantize_symmetric(w, (0,)))
            else:
                q, s = int4.quantize_int4(w, int4.PER_CHANNEL)
                weights.append((int4.pack_int4(q), s))
        if kind == "int8":
            fn = _program(lambda a, w, s: cpu_kernels.int8_dense(a, w, s), copies)
        else:
            fn = _program(lambda a, p, s: cpu_kernels.int4_dense(a, p, s, k), copies)
        times = {"serial": [], "split": []}
        jax.block_until_ready(fn(x, weights))
        for _ in range(rounds):
            for mode in rng.permutation(list(times)):
                cpu_kernels.set_serial_max_bytes(2**62 if mode == "serial" else 0)
                start = time.perf_counter()
                jax.block_until_ready(fn(x, weights))
                times[mode].append((time.perf_counter() - start) / copies)
        cpu_kernels.set_serial_max_bytes(None)
        serial, split = np.median(times["serial"]), np.median(times["split"])
        ratio = np.median(np.array(times["serial"]) / np.array(times["split"]))
        lines.append(f"{k}x{n} {kind} ({nbytes / 1024:.0f} KiB): serial {serial * 1e6:.1f} us, split "
                     f"{split * 1e6:.1f} us, serial/split {ratio:.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="K x N")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    if not cpu_kernels.AVAILABLE:
        print(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    print(f"serial_max_bytes default: {cpu_kernels.serial_max_bytes()}; path {cpu_kernels.path()}")
    for shape in args.shapes:
        k, n = (int(v) for v in shape.lower().split("x"))
        for line in bench(k, n, args.rounds):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
