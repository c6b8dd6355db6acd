"""Decode-step latency of SmolLM2-135M at cache length 256 (batch 1) under uniform policies,
timed side by side: jitted, warmed up, interleaved repetitions, medians and quartiles.

    .venv/bin/python benchmarks/bench_smollm2.py [--reps 30] [--policies float32 mixed_bfloat16 ...]
    .venv/bin/python benchmarks/bench_smollm2.py --policies float32 gptq/4/32_from_float32 \
        gptq/4/32_from_float32@cpu_ffi      # GPTQ/AWQ policies are calibrated first (minutes)

Prints each policy's median milliseconds per decode step (tokens/s) with the interquartile
range, and its speed-up over float32 with the quartiles of the per-round ratios.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent / "experiments")]  # the other benchmarks; the tasks
import smollm2  # noqa: E402

from autopolicy import nn  # noqa: E402
from autopolicy.numerics import cpu_kernels  # noqa: E402
from autopolicy.nn import generation  # noqa: E402


def with_policy(model, spec: str, calibrate=None):
    """The model under a uniform policy, ``POLICY@KERNEL``: the layers that offer the kernel run it.
    ``calibrate(model, policy) -> model`` sets the weights of GPTQ/AWQ policies (their layers run only
    once calibrated)."""
    policy, _, kernel = spec.partition("@")
    tuned = model if policy == "float32" else model.with_dtype_policy(policy)
    if policy.startswith(("gptq/", "awq/")):
        tuned = calibrate(tuned, policy)
    if kernel:
        layers = tuned.layers_by_path()
        tuned = tuned.with_kernels({path: kernel for path, layer in layers.items()
                                    if layer.quantization_mode is not None and kernel in layer.kernel_choices()})
    return tuned


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--inner", type=int, default=5, help="decode steps per timed sample")
    parser.add_argument("--warm", type=int, default=3, help="untimed decode steps before each timed sample")
    parser.add_argument("--cache", type=int, default=smollm2.CACHE)
    parser.add_argument("--calibration-windows", type=int, default=smollm2.BATCH,
                        help="calibration-split windows GPTQ/AWQ policies are calibrated on")
    parser.add_argument("--policies", nargs="+", default=["float32", "mixed_bfloat16", "int8_from_float32"],
                        help="uniform policies; POLICY@KERNEL runs every layer that has KERNEL with it "
                             "(int8_from_float32@cpu_ffi: autopolicy's CPU kernels)")
    parser.add_argument("--compare-spin", action="store_true",
                        help="also time each POLICY@KERNEL with the CPU kernels' tasks on XLA's pool instead of "
                             "the kernels' own polling helpers (cpu_kernels.set_spin_us(0)), interleaved")
    args = parser.parse_args(argv)
    model, _, tok = smollm2.load()
    windows = smollm2.windows(tok, "calibration", None)
    batches = [(windows[smollm2.WINDOWS + i : smollm2.WINDOWS + i + 1],) for i in range(args.calibration_windows)]
    calibrated = {}

    def calibrate(tuned, key):  # each policy once, whichever kernels run it
        if key not in calibrated:
            t0 = time.perf_counter()
            calibrated[key] = nn.calibrate_weights(tuned, batches)
            print(f"calibrated {key} on {len(batches)} windows in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        return calibrated[key]

    models = {p: with_policy(model, p, calibrate) for p in args.policies}
    no_spin = {f"{p} (XLA pool)" for p in args.policies if "@" in p} if args.compare_spin else set()
    models.update({p: models[p.removesuffix(" (XLA pool)")] for p in sorted(no_spin)})
    token, start, _ = smollm2.decode_input(model, args.cache)
    token, start = jnp.asarray(token[:, 0]), jnp.asarray(start)
    # decode_step donates its cache: each model threads its own (every step writes the same
    # position, so each times the same work).
    caches = {p: model.init_cache(1, args.cache) for p in models}

    def step(p, m):
        if no_spin:
            cpu_kernels.set_spin_us(0 if p in no_spin else None)
        # Untimed steps first: the model that ran before left its own weights in the caches, and a
        # generation runs one model step after step (on a CPU whose last-level cache holds the
        # quantized weights, its steady state is the figure that matters).
        for _ in range(args.warm):
            out, caches[p] = generation.decode_step(m, caches[p], token, start)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(args.inner):
            out, caches[p] = generation.decode_step(m, caches[p], token, start)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / args.inner

    for p, m in models.items():  # compile and warm up
        step(p, m), step(p, m)
    samples = {p: [] for p in models}
    for _ in range(args.reps):
        for p, m in models.items():
            samples[p].append(step(p, m))
    base = np.asarray(samples[args.policies[0]])
    print(f"decode step, batch 1, cache {args.cache}; {args.reps} interleaved rounds of {args.inner} steps "
          f"after {args.warm} untimed; "
          f"{jax.devices()[0].device_kind}")
    for p, s in samples.items():
        s = np.asarray(s)
        q1, med, q3 = np.percentile(s, [25, 50, 75]) * 1e3
        r1, rm, r3 = np.percentile(base / s, [25, 50, 75])
        print(f"{p:36s} {med:7.2f} ms [{q1:.2f}, {q3:.2f}]  {1e3 / med:6.1f} tokens/s  "
              f"x{rm:.2f} [{r1:.2f}, {r3:.2f}] vs {args.policies[0]}")


if __name__ == "__main__":
    main()
