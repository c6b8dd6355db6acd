"""Past one machine, measured: sharded layers timed with their collectives, and the MiniLM
sensitivity table scored by 1, 2, ... workers.

Two parts, each in its own process (a process's JAX device count is fixed at start):

- ``sharded``: 4 forced CPU devices (``JAX_NUM_CPU_DEVICES=4``). A Megatron-style MLP
  (column- then row-parallel, 2x2 mesh) and MiniLM with its batch sharded over 4 devices
  (data parallel), Auto and Explicit axes: every candidate's median, its spread (p25-p75 as a
  percentage of the median) and the collectives it compiles to, from ``tune``'s profile.
- ``workers``: the MiniLM complete sensitivity table (``profile_accuracy="always"``, every layer
  under each candidate, scored one layer at a time) on this process alone, then with
  ``processes:N`` executors for N in ``--workers``: the sensitivity phase's wall time, the speed-up
  and parallel efficiency, and whether every score equals the single-process run's. From the
  measured cost of one evaluation it projects, on paper, the SmolLM2 table on 8 and 64 workers.

    python benchmarks/bench_scale.py                      # both parts
    python benchmarks/bench_scale.py workers --workers 1,2,ray:2 --candidates int8_from_float32,mixed_bfloat16

Prints tables in Markdown (``reports/scale-<machine-class>.md`` is this output, with the machine named).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sharded(args: argparse.Namespace) -> None:
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

    from autopolicy import experiment, nn, search  # pylint: disable=import-outside-toplevel
    from autopolicy.search import hardware  # pylint: disable=import-outside-toplevel

    if jax.device_count() < 4:
        raise SystemExit("the sharded part needs 4 devices: JAX_NUM_CPU_DEVICES=4 (set before JAX starts)")
    print(f"## Sharded layers on {jax.device_count()} forced CPU devices\n")
    print(f"device: {hardware.describe()}; the 4 devices share the machine's cores; "
          f"load average before: {os.getloadavg()[0]:.1f}\n")
    candidates = tuple(args.candidates.split(","))

    def table(title, model, x, fidelity_inputs):
        reference = model(*fidelity_inputs)

        def fidelity(m):
            out = m(*fidelity_inputs)
            return 1.0 - float(jnp.mean(jnp.abs(out.astype(jnp.float32) - reference)))

        start = time.perf_counter()
        result = search.tune(model, fidelity, x, candidates=("float32",) + candidates, max_drop=0.05,
                             repeats=args.repeats, progress=False, profile_accuracy="auto")
        frame = result.profile
        print(f"### {title} ({time.perf_counter() - start:.0f} s to tune)\n")
        print("| layer | policy | kernel | median (ms) | spread (p25-p75, % of median) | collectives |")
        print("|---|---|---|---|---|---|")
        repeated = frame.layer.str.contains(r"block_[1-9]")  # identical blocks: timed as block 0
        if repeated.any():
            frame = frame[~repeated]
        for row in frame.itertuples():
            spread = 100.0 * (row.latency_p75_s - row.latency_p25_s) / row.latency_s
            print(f"| {row.layer} | {row.policy} | {row.kernel or '-'} | {row.latency_s * 1e3:.3f} | {spread:.0f}% | "
                  f"{row.collectives} |")
        if repeated.any():
            print("\n(blocks 1-5 have block 0's signatures: the tuner times them once, and they are left out here)")
        chosen = {path: policy.name for path, policy in result.policy_map.items()}
        print(f"\nchosen: {chosen or 'float32 everywhere'}\n")

    for explicit in (True, False):
        kind = AxisType.Explicit if explicit else AxisType.Auto
        axes = "Explicit" if explicit else "Auto"
        mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind, kind))
        x = jnp.asarray(np.random.default_rng(0).normal(size=(256, 1024)), jnp.float32)
        mlp = nn.Sequential([nn.Dense(4096, activation="relu"), nn.Dense(1024)], name="mlp").build(
            jax.random.key(0), x)
        specs = {".layers[0].kernel": P(None, "model"), ".layers[0].bias": P("model"),
                 ".layers[1].kernel": P("model", None), ".layers[1].bias": P()}
        with jax.set_mesh(mesh):
            placed = jax.tree_util.tree_map_with_path(
                lambda p, leaf: jax.device_put(leaf, NamedSharding(mesh, specs[jax.tree_util.keystr(p)])), mlp)
            xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
            table(f"MLP 256x1024 -> 4096 -> 1024, mesh 2x2 (data, model), {axes} axes, column- then row-parallel",
                  placed, xs, (xs,))
        if args.minilm:
            exp = experiment.load("minilm").build(None)
            mesh4 = jax.make_mesh((4,), ("data",), axis_types=(kind,))
            with jax.set_mesh(mesh4):
                model = jax.device_put(exp.model, NamedSharding(mesh4, P()))
                inputs = tuple(jax.device_put(a, NamedSharding(mesh4, P("data", None))) for a in exp.sample_input)
                table(f"MiniLM, batch {inputs[0].shape[0]} sharded over 4 devices (data parallel), {axes} axes",
                      model, inputs, inputs)


def _workers(args: argparse.Namespace) -> None:
    from autopolicy import experiment, search  # pylint: disable=import-outside-toplevel
    from autopolicy.search import hardware  # pylint: disable=import-outside-toplevel

    exp = experiment.load("minilm").build(None)
    candidates = ("float32",) + tuple(args.candidates.split(","))
    print("## MiniLM complete sensitivity table on workers\n")
    print(f"device: {hardware.describe()}; candidates {', '.join(candidates[1:])}; "
          f"load average before: {os.getloadavg()[0]:.1f}\n")

    # One machine-wide cache for every run: the first run's layer timings (and so its kernel
    # choices, which the scores depend on) are reused by the others; accuracy never comes from it.
    shared = tempfile.mkdtemp(prefix="bench-scale-shared-")

    def run(executor):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            result = search.tune(exp.model, exp.eval_fn, exp.sample_input, candidates=candidates,
                                 max_drop=exp.max_drop, relative=exp.relative, cache_dir=tmp,
                                 calibration_inputs=exp.calibration_inputs, repeats=args.repeats, progress=False,
                                 profile_accuracy="always", executor=executor, shared_cache_dir=shared)
            return result, time.perf_counter() - start

    def difference(a, b):
        """The largest metric difference between two sensitivity tables (0.0: identical)."""
        return max(abs(a.entries[p][n].metric - b.entries[p][n].metric)
                   for p in a.entries for n in a.entries[p] if n != "float32")

    base, base_wall = run(None)
    evaluations = base.accuracy.evaluations
    phase = base.costs["phases_s"]["sensitivity"]
    per_eval = phase / max(evaluations, 1)
    print("| executor | sensitivity phase (s) | speed-up | efficiency | whole tune (s) | scores identical |")
    print("|---|---|---|---|---|---|")
    print(f"| none (this process) | {phase:.1f} | 1.00x | - | {base_wall:.0f} | - |")
    for spec in args.workers.split(","):
        engine, _, count = spec.rpartition(":")
        n = int(count)
        if engine == "ray":  # a local Ray cluster of n CPUs, one actor each
            import ray  # pylint: disable=import-outside-toplevel

            from autopolicy.distributed import RayExecutor  # pylint: disable=import-outside-toplevel

            ray.init(num_cpus=n, include_dashboard=False, log_to_driver=False)
            try:
                with RayExecutor(num_workers=n) as actors:
                    result, wall = run(actors)
            finally:
                ray.shutdown()
        else:
            with concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
                result, wall = run(pool)
        seconds = result.costs["phases_s"]["sensitivity"]
        same = result.accuracy.entries == base.accuracy.entries
        same_text = "yes" if same else f"NO (max metric difference {difference(result.accuracy, base.accuracy):.2g})"
        print(f"| {engine or 'processes'}:{n} | {seconds:.1f} | {phase / seconds:.2f}x | {phase / seconds / n:.0%} | "
              f"{wall:.0f} | {same_text} |")
    print(f"\n{evaluations} one-layer evaluations, {per_eval:.2f} s each on this process (the workers' times include "
          "loading the model once per worker and compiling each candidate there).\n")
    if args.smollm2_eval_s:
        layers, per_layer = 211, len(candidates) - 1
        total = layers * per_layer * args.smollm2_eval_s
        print(f"On paper, SmolLM2-135M ({layers} tunable layers x {per_layer} candidates = {layers * per_layer} "
              f"one-layer perplexity evaluations at {args.smollm2_eval_s:.0f} s each, measured as the float32 "
              f"perplexity evaluation on this machine): {total / 3600:.1f} h on one process; "
              f"{total / 8 / 60:.0f} min on 8 workers and {total / 64 / 60:.1f} min on 64, before each worker's "
              "start-up (load and compile, about one evaluation) and assuming this efficiency holds.\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=("all", "sharded", "workers"), default="all")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts for processes:N; "
                        "ray:N for N Ray actors (the distributed extra)")
    parser.add_argument("--candidates", default="int8_from_float32,mixed_bfloat16,int4_from_float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-minilm", dest="minilm", action="store_false",
                        help="sharded part: the MLP only")
    parser.add_argument("--smollm2-eval-s", type=float, default=0.0,
                        help="seconds of one SmolLM2 perplexity evaluation on this machine (for the projection)")
    args = parser.parse_args(argv)
    if args.part == "all":
        forward = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "all"]
        env = {**os.environ, "JAX_NUM_CPU_DEVICES": "4"}
        status = subprocess.call([sys.executable, __file__, "sharded", *forward], env=env, cwd=ROOT)
        return status or subprocess.call([sys.executable, __file__, "workers", *forward], cwd=ROOT)
    (_sharded if args.part == "sharded" else _workers)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
