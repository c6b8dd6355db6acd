"""What loss scaling costs per training step: the loss-scaled optimizer vs the bare optax one.

All candidates are full jitted training steps of the same mixed-precision model (forward,
backward, Adam update, parameter update). "loss-scaled" scales the loss and runs
:func:`autopolicy.loss_scale_optimizer` (unscale, inf/NaN check, skip, dynamic scale update);
"loss-scaled, as in fit" also keeps a skipped step's parameters bit-identical with its own check
and select, as :func:`autopolicy.train.fit` does. The headline ratio compares "loss-scaled" with
the bare optax step.

Timing: each candidate is compiled with its training state donated, warmed up, then run as a
chain of steps (each step's state feeds the next, so every output stays live and nothing can be
dropped by the compiler), blocking at the end of each timed chain. Candidates are timed
round-robin in a fresh random order every round; the table reports medians and quartiles of the
per-step time.

    python benchmarks/bench_lossscale.py [--out reports/lossscale-<machine-class>.md]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autopolicy as ap
import autopolicy.nn as nn
from autopolicy._atomic import write_text
from autopolicy.train.losses import sparse_categorical_crossentropy

TARGET_RATIO = 1.05
TARGET_SAMPLE_SECONDS = 0.05  # each timed chain lasts at least this long (amortizes dispatch)
MAX_STEPS_PER_SAMPLE = 200


def build_mlp(width: int, depth: int, classes: int, policy: str) -> nn.Module:
    layers = [nn.Dense(width, activation="relu") for _ in range(depth)] + [nn.Dense(classes)]
    return nn.Sequential(layers, name="mlp", dtype=policy).build(jax.random.key(0), jnp.ones((1, width)))


def bare_step(optimizer: optax.GradientTransformation):
    def step(state, x, y):
        model, opt_state = state
        loss, grads = jax.value_and_grad(lambda m: sparse_categorical_crossentropy(y, m(x)))(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return (optax.apply_updates(model, updates), opt_state), loss

    return step


def loss_scaled_step(optimizer: optax.GradientTransformation, as_in_fit: bool = False):
    def step(state, x, y):
        model, opt_state = state

        def objective(m):
            loss = sparse_categorical_crossentropy(y, m(x))
            return opt_state.loss_scale.scale(loss), loss

        grads, loss = jax.grad(objective, has_aux=True)(model)
        updates, new_opt_state = optimizer.update(grads, opt_state, model)
        new_model = optax.apply_updates(model, updates)
        if as_in_fit:
            new_model = ap.select_tree(ap.all_finite(grads), new_model, model)
        return (new_model, new_opt_state), loss

    return step


def _copy(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), tree)


def _run_chain(step: Callable, state: Any, x: jax.Array, y: jax.Array, n: int) -> tuple[Any, float]:
    start = time.perf_counter()
    loss = None
    for _ in range(n):
        state, loss = step(state, x, y)
    jax.block_until_ready((state, loss))
    return state, time.perf_counter() - start


def time_steps(
    candidates: dict[str, tuple[Callable, Any]], x: Any, y: Any, repeats: int, warmup: int, seed: int
) -> dict[str, dict[str, float]]:
    """Seconds per step of each ``(step_fn, state)`` candidate: median, p25, p75, robust CV."""
    x, y = jnp.asarray(x), jnp.asarray(y)
    steps, states, per_sample = {}, {}, {}
    for name, (fn, state) in candidates.items():
        steps[name] = jax.jit(fn, donate_argnums=0)
        states[name] = _copy(state)  # donated: each candidate owns its buffers
        states[name], _ = _run_chain(steps[name], states[name], x, y, 1)  # compile
        states[name], single = _run_chain(steps[name], states[name], x, y, 1)
        per_sample[name] = int(min(MAX_STEPS_PER_SAMPLE, max(1, math.ceil(TARGET_SAMPLE_SECONDS / single))))
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            states[name], _ = _run_chain(steps[name], states[name], x, y, per_sample[name])
    samples: dict[str, list[float]] = {name: [] for name in names}
    rng = np.random.default_rng(seed)
    for _ in range(repeats):
        for i in rng.permutation(len(names)):
            name = names[i]
            states[name], seconds = _run_chain(steps[name], states[name], x, y, per_sample[name])
            samples[name].append(seconds / per_sample[name])
    out = {}
    for name, values in samples.items():
        median = float(np.median(values))
        p25, p75 = (float(v) for v in np.percentile(values, [25, 75]))
        out[name] = {"median": median, "p25": p25, "p75": p75, "cv": (p75 - p25) / 1.349 / median,
                     "steps": per_sample[name]}
    return out


def run(args: argparse.Namespace) -> tuple[str, float]:
    model = build_mlp(args.width, args.depth, args.classes, args.policy)
    rng = np.random.default_rng(args.seed)
    x = rng.normal(size=(args.batch, args.width)).astype(np.float32)
    y = rng.integers(0, args.classes, size=args.batch).astype(np.int32)
    inner = optax.adam(1e-3)
    wrapped = ap.loss_scale_optimizer(inner, ap.DynamicLossScale())
    candidates = {
        "bare optax": (bare_step(inner), (model, inner.init(model))),
        "loss-scaled": (loss_scaled_step(wrapped), (model, wrapped.init(model))),
        "loss-scaled, as in fit": (loss_scaled_step(wrapped, True), (model, wrapped.init(model))),
    }
    timings = time_steps(candidates, x, y, args.repeats, args.warmup, args.seed)
    bare = timings["bare optax"]["median"]
    ratio = timings["loss-scaled"]["median"] / bare
    device = jax.devices()[0]
    params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(model))
    lines = [
        f"Loss-scaling overhead per training step on {device.device_kind} ({device.platform}): "
        f"MLP {args.depth}x{args.width} -> {args.classes} ({params / 1e6:.1f}M params), batch {args.batch}, "
        f"{args.policy}, Adam; {args.repeats} interleaved rounds.",
        "",
        "| step | median ms | p25 ms | p75 ms | robust CV | vs bare | steps per timed chain |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t in timings.items():
        lines.append(
            f"| {name} | {t['median'] * 1e3:.3f} | {t['p25'] * 1e3:.3f} | {t['p75'] * 1e3:.3f} | {t['cv']:.3f} "
            f"| {t['median'] / bare:.3f} | {t['steps']} |"
        )
    verdict = "meets" if ratio <= TARGET_RATIO else "misses"
    lines += ["", f"Ratio loss-scaled / bare: **{ratio:.3f}** ({verdict} the target <= {TARGET_RATIO})."]
    return "\n".join(lines) + "\n", ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024, help="hidden and input width")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--policy", default="mixed_float16", help="the model's dtype policy")
    parser.add_argument("--repeats", type=int, default=31, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds after compiling")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the Markdown table here (atomically)")
    args = parser.parse_args(argv)
    table, _ = run(args)
    sys.stdout.write(table)
    if args.out:
        write_text(args.out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
