"""A SmolLM2-135M decode step with its projections that share an input grouped into one call of
the CPU kernels (q/k/v, gate/up: ``autopolicy.nn._grouping``), against the same model calling
each projection on its own, in one process.

    .venv/bin/python experiments/ab_grouped_projections.py [--rounds 30] [--steps 8]
        [--policies int4_from_float32 int8_from_float32] [--kernels cpu_ffi cpu_ffi_avx2]

Each policy x kernel is compiled twice ahead of time, with ``AUTOPOLICY_GROUPED_PROJECTIONS``
on and off (the setting is read when a step is traced, so the two programs differ only there);
float32 is compiled once. A round times every program, in alternating order, each a compiled
loop of ``--steps`` greedy decode steps at cache length ``smollm2.CACHE``; a ratio is the median
over rounds of the ungrouped program's time over the grouped one's in the same round, with its
quartiles (> 1: grouping is faster). Writes nothing; the first line names the CPU.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import smollm2  # noqa: E402

from autopolicy.numerics import grouped as grouping  # noqa: E402
from autopolicy.numerics import cpu_kernels  # noqa: E402
from autopolicy.search import hardware  # noqa: E402


def compiled_loop(model, steps: int, grouped: bool):
    """``(run, cache)``: ``run(cache) -> (tokens, cache)``, ``steps`` greedy decode steps from the
    end of the cache, compiled with grouping on or off."""
    leaves, treedef = jax.tree_util.tree_flatten(model)
    start = smollm2.CACHE - steps

    def loop(leaves, cache, token):
        m = jax.tree_util.tree_unflatten(treedef, leaves)

        def body(i, carry):
            cache, t = carry
            logits, cache = m(t[:, None], start=start + i, cache=cache)
            return cache, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)

        cache, t = jax.lax.fori_loop(0, steps, body, (cache, token))
        return t, cache

    cache = model.init_cache(1, smollm2.CACHE)
    token = jnp.zeros((1,), jnp.int32)
    before = os.environ.get(grouping.GROUPED_ENV)
    os.environ[grouping.GROUPED_ENV] = "1" if grouped else "0"
    try:
        program = jax.jit(loop, donate_argnums=1).lower(leaves, cache, token).compile()
    finally:
        if before is None:
            os.environ.pop(grouping.GROUPED_ENV)
        else:
            os.environ[grouping.GROUPED_ENV] = before
    text = program.as_text() or ""
    return (lambda c: program(leaves, c, token)), cache, text.count("dense_group")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
    parser.add_argument("--policies", nargs="+", default=["int4_from_float32", "int8_from_float32"])
    parser.add_argument("--kernels", nargs="+", default=list(cpu_kernels.FFI_KERNELS), choices=list(cpu_kernels.FFI_KERNELS))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps must be >= 1. Received: {args.rounds}, {args.steps}")
    if not cpu_kernels.AVAILABLE:
        print(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    print(f"device: {hardware.describe()}", flush=True)
    model, _, _ = smollm2.load()
    programs = {"float32": compiled_loop(model, args.steps, False)}
    for policy in args.policies:
        built = model.with_dtype_policy(policy)
        for kernel in args.kernels:
            offered = {p: kernel for p, layer in built.layers_by_path().items()
                       if layer.quantization_mode is not None and kernel in layer.kernel_choices()}
            if not offered:
                print(f"{policy}: no layer offers {kernel}; left out", flush=True)
                continue
            with_kernel = built.with_kernels(offered)
            for grouped in (True, False):
                programs[(policy, kernel, grouped)] = compiled_loop(with_kernel, args.steps, grouped)
            print(f"{policy}, {kernel}: grouped calls in the program: {programs[(policy, kernel, True)][2]} "
                  f"(ungrouped: {programs[(policy, kernel, False)][2]})", flush=True)
    caches = {name: p[1] for name, p in programs.items()}

    def timed(name):
        run = programs[name][0]
        tokens, caches[name] = run(caches[name])
        jax.block_until_ready(tokens)
        t0 = time.perf_counter()
        tokens, caches[name] = run(caches[name])
        jax.block_until_ready(tokens)
        return (time.perf_counter() - t0) / args.steps

    names = list(programs)
    for name in names:
        timed(name)
    samples = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(timed(name))
    f32 = np.asarray(samples["float32"])
    print(f"float32: {np.median(f32) * 1e3:.2f} ms a step; {args.rounds} rounds of {args.steps} steps")
    for name in names[1:]:
        policy, kernel, grouped = name
        if not grouped:
            continue
        g, s = np.asarray(samples[name]), np.asarray(samples[(policy, kernel, False)])
        ratio = s / g
        q1, med, q3 = np.percentile(ratio, [25, 50, 75])
        print(f"{policy}, {kernel}: grouped {np.median(g) * 1e3:.3f} ms ({np.median(f32 / g):.2f}x float32), "
              f"one by one {np.median(s) * 1e3:.3f} ms ({np.median(f32 / s):.2f}x); grouped faster by "
              f"{med:.3f}x [{q1:.3f}, {q3:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
