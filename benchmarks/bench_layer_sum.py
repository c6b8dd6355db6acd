"""Do layers timed alone add up to the model? The search's latency model, checked per timing rule.

For each uniform policy, every distinct layer of an experiment's model is timed alone (as the
search times it: ``timing.measure``, the layer in a compiled loop) together with the whole
model, in one interleaved run; the sum of the layers (each times how often it occurs) is then
compared with the model. A sum near the model's time means the isolated timings rank mixes of
policies as the model runs them; a sum many times the model's means something other than the
layers' work (the fixed cost of a call, a loop's per-iteration cost) dominates.

Rules compared (``--rules``):

- ``single``: the iterations per timed call sized from one iteration alone (the search's rule on
  CPUs, and everywhere up to ``timing.METHOD`` "loop-carry-5"): a call's fixed cost partly
  counts as work.
- ``slope``: sized from calls of 1 and of many iterations, so that the fixed cost is at most
  ``timing.FIXED_SHARE`` of a timed call (the search's rule on other platforms).

With ``--unroll U`` each layer's loop body runs the layer U times in a dependent chain too (a
loop's own per-iteration cost, such as a GPU's host round trip for the loop's condition, is then
paid once per U calls). An empty program timed alike gives the loop's own per-iteration cost.

Run: ``python benchmarks/bench_layer_sum.py encoder_latency --out reports/layer-sum-encoder_latency-<machine-class>.md``
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import _atomic, policies
from autopolicy.search import hardware, timing
from autopolicy.search.adapter import get_adapter

# The experiments are scripts, imported by name from the tasks folder.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))


_CHOOSE_INNER = timing.choose_inner  # the rules below are swapped in for it while timing


def single_rule(runner, target_seconds=timing.TARGET_CALL_SECONDS, fixed_is_work=False):
    del fixed_is_work
    return _CHOOSE_INNER(runner, target_seconds, fixed_is_work=True)


def slope_rule(runner, target_seconds=timing.TARGET_CALL_SECONDS, fixed_is_work=False):
    del fixed_is_work
    return _CHOOSE_INNER(runner, target_seconds, fixed_is_work=False)


RULES = {"single": single_rule, "slope": slope_rule}


def unrolled(program, times: int) -> timing.Candidate:
    """The program run ``times`` times per call, each run's input tied to the last one's output
    through a runtime zero (the last input), so that XLA can neither merge nor drop any."""
    if times == 1:
        return timing.Candidate(program.fn, program.args, program.state)

    def fn(state, *args):
        *inputs, zero = args
        out = None
        for _ in range(times):
            if out is not None:
                scalar = jax.tree_util.tree_leaves(out)[0].reshape(-1)[0].astype(jnp.float32) * zero
                leaves, treedef = jax.tree_util.tree_flatten(inputs)
                leaves = [leaf + scalar.astype(leaf.dtype) if i == 0 else leaf for i, leaf in enumerate(leaves)]
                inputs = jax.tree_util.tree_unflatten(treedef, leaves)
            out = program.fn(state, *inputs)
        return out

    return timing.Candidate(fn, tuple(program.args) + (jnp.zeros((), jnp.float32),), program.state)


def empty_program() -> timing.Candidate:
    return timing.Candidate(lambda state, x: x * 1.0, (jnp.ones((8,), jnp.float32),))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", help="a built-in experiment under experiments/")
    parser.add_argument("--policies", nargs="+", default=["float32", "mixed_bfloat16", "int8_from_float32"])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    parser.add_argument("--unroll", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--cache-dir", default=os.path.join("runs", "cache"), help="where trained models are kept")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    exp = importlib.import_module(args.experiment).build(args.cache_dir)
    sample = exp.sample_input if isinstance(exp.sample_input, tuple) else (exp.sample_input,)
    calibration = [c if isinstance(c, tuple) else (c,) for c in exp.calibration_inputs]
    adapter = get_adapter(exp.model, sample, calibration)
    layers = adapter.layers()
    distinct: dict[str, list] = {}
    for layer in layers:
        distinct.setdefault(layer.signature, []).append(layer)
    start = time.perf_counter()
    rows = []
    for name in args.policies:
        policy = policies.get(name)
        uses = [group for group in distinct.values() if group[0].supports(policy)]
        assignment = {layer.path: policy for group in uses for layer in group}
        model = adapter.model_program(adapter.with_policies(adapter.complete_map(assignment)))
        # One timer per policy: the model, and every layer under every rule and unroll, timed in
        # the same interleaved rounds (each candidate's iterations per call set by its rule).
        # unroll=1: this script unrolls (``--unroll``) itself, on every platform alike.
        timer = timing.Timer({"model": timing.Candidate(model.fn, model.args, model.state)}, unroll=1)
        for rule in args.rules:
            original = timing.choose_inner
            timing.choose_inner = RULES[rule]
            try:
                timer.add({f"empty/{rule}": empty_program()})
                for times in args.unroll:
                    timer.add({f"layer{i}/{rule}/{times}": unrolled(adapter.layer_program(group[0].path, policy), times)
                               for i, group in enumerate(uses)})
            finally:
                timing.choose_inner = original
        timer.rounds(args.repeats)
        result = timer.timings()
        model_s = result["model"].median
        count = sum(len(group) for group in uses)
        for rule in args.rules:
            empty = result[f"empty/{rule}"].median
            for times in args.unroll:
                layer = {i: result[f"layer{i}/{rule}/{times}"] for i in range(len(uses))}
                total = sum(layer[i].median / times * len(group) for i, group in enumerate(uses))
                loop = empty / times  # the loop's own cost per layer call
                rows.append((name, rule, times, 1e3 * model_s, 1e3 * total, total / model_s,
                             max(total - count * loop, 0.0) / model_s, 1e6 * empty,
                             int(np.median([t.inner for t in layer.values()])), count))
                print(f"{name:>20} {rule:>6} unroll {times}: model {1e3 * model_s:.3f} ms, layers' sum "
                      f"{1e3 * total:.3f} ms ({total / model_s:.2f}x), empty loop {1e6 * empty:.1f} us/iteration, "
                      f"median inner {rows[-1][8]}", flush=True)
        _write(args, argv, rows, start, done=name == args.policies[-1])
    return 0


def _write(args, argv, rows, start, done):
    args_given = sys.argv[1:] if argv is None else list(argv)
    lines = [
        f"# Layers timed alone vs the whole model: `{args.experiment}`",
        "",
        f"Device: {hardware.describe()}. Command: "
        f"`{shlex.join(['python', 'benchmarks/bench_layer_sum.py'] + args_given)}` "
        f"({time.perf_counter() - start:.0f} s).",
        "",
        "Each policy's rows come from one interleaved run (`timing.Timer`, median of "
        f"{args.repeats} rounds) of the whole model and of each distinct layer under that uniform "
        "policy, under every rule and unroll. *sum / model*: the layers' isolated medians summed over the model's "
        "layers, over the model's median (1.00 = the isolated timings add up). *less loop*: the same "
        "after taking the empty loop's per-iteration cost off each layer call.",
        "",
        "| policy | rule | unroll | model ms | layers' sum ms | sum / model | less loop | empty loop us/it | median inner | layers |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.2f} | {r[6]:.2f} | {r[7]:.1f} | "
                     f"{r[8]} | {r[9]} |")
    if not done:
        lines += ["", "*Incomplete: written after each policy; the run has not finished.*"]
    text = "\n".join(lines) + "\n"
    if done:
        print(text)
    if args.out:
        _atomic.write_text(args.out, text)


if __name__ == "__main__":
    raise SystemExit(main())
