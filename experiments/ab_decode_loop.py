"""Greedy decoding of SmolLM2-135M two ways, side by side in one process: a Python loop of
``generation.decode_step`` calls (one dispatch, and one flattening of the model's arrays, per
token) against ``generation.decode_steps`` (the steps in one compiled loop, as
``greedy_generate`` runs them), for float32 and a tuned map.

Each round times ``--steps`` steps of every (model, way) once, in a fixed interleaved order,
after an untimed call of the same; prints the median ms a step [quartiles] and the float32/tuned
ratio of each way (median [quartiles] over rounds), after the device and its CPU features::

    python experiments/ab_decode_loop.py --tuned runs/smollm2 --rounds 15 --steps 5
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import autopolicy as ap
import report_smollm2
import smollm2
from autopolicy.nn import generation
from autopolicy.numerics import cpu_kernels
from autopolicy.search import hardware


def ways(model, cache_length: int, steps: int) -> dict:
    """The two ways of running ``steps`` greedy steps of ``model`` ending at ``cache_length - 1``."""
    state = {"cache": model.init_cache(1, cache_length)}
    token, start = jnp.zeros((1,), jnp.int32), cache_length - steps

    def python_loop():
        t = token
        for i in range(steps):
            logits, state["cache"] = generation.decode_step(model, state["cache"], t, jnp.asarray(start + i, jnp.int32))
            t = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return t

    def compiled_loop():
        out, state["cache"] = generation.decode_steps(model, state["cache"], token, start, steps)
        return out

    return {"decode_step": python_loop, "decode_steps": compiled_loop}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tuned", type=pathlib.Path, required=True, help="a `autopolicy tune smollm2` run directory")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    model, _, tok = smollm2.load()
    policies, kernels, _ = report_smollm2.tuned_from_run(args.tuned)
    tuned = model.with_dtype_policy(ap.DTypePolicyMap("float32", policies))
    tuned = report_smollm2.with_kernels(
        report_smollm2.calibrated(tuned, model, report_smollm2.calibration_batches(tok), {}), kernels)
    runs = {(name, way): fn for name, m in (("float32", model), ("tuned", tuned))
            for way, fn in ways(m, smollm2.CACHE, args.steps).items()}
    for fn in runs.values():
        jax.block_until_ready(fn())
    samples = {key: [] for key in runs}
    for _ in range(args.rounds):
        for key, fn in runs.items():
            jax.block_until_ready(fn())  # untimed: steady state for this model
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            samples[key].append((time.perf_counter() - t0) / args.steps)
    kernel_path = cpu_kernels.path() if cpu_kernels.AVAILABLE else "none (XLA only)"
    print(f"{hardware.describe()}; CPU kernel path {kernel_path}; {args.rounds} rounds of {args.steps} steps "
          f"at cache {smollm2.CACHE}")
    for way in ("decode_step", "decode_steps"):
        f32, q = np.asarray(samples[("float32", way)]), np.asarray(samples[("tuned", way)])
        r = f32 / q
        print(f"{way:13s} float32 {np.median(f32) * 1e3:6.2f} ms  tuned {np.median(q) * 1e3:6.2f} ms a step  "
              f"speed-up {np.median(r):.2f}x [{np.percentile(r, 25):.2f}, {np.percentile(r, 75):.2f}]")


if __name__ == "__main__":
    main()
