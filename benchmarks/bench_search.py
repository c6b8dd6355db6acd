"""Benchmark: the tuner against the strategies of its peers, on the same models and measurements.

Strategies, all given the same per-layer latency and sensitivity tables (one profiling run per
model) and the same accuracy budget:

- every uniform policy (each layer on one policy where it has a kernel for it, else float32);
- greedy fallback (Intel Neural Compressor's "basic" tuning): every layer on its fastest
  policy, then layers reverted to float32 one at a time, most harmful first, a full evaluation
  after each step, until the budget holds;
- bisection (ONNX Runtime's auto mixed precision): the largest blocks of consecutive layers that
  pass on their fastest policy, found by splitting failing blocks in halves (each test a full
  evaluation of the block together with the blocks already accepted);
- a HAWQ-V3-style proxy: per-layer Hessian traces (Hutchinson's estimator) times the weight
  perturbation of each policy, and an exact knapsack over the summed per-layer latency table;
  its proxy budget is scaled once against the all-fastest model's measured drop; no end-to-end
  verification;
- on digits_mlp (3 layers x 5 policies), the exhaustive oracle: every combination measured end
  to end.

The final configurations of all strategies are timed end to end together, interleaved, and
scored on validation (the budget) and held-out test data.

Run: ``python benchmarks/bench_search.py`` (the report goes to ``reports/search-<machine-class>.md``, with a
``.json`` and a ``.png`` beside it; ``--out`` names another file)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import _atomic, experiment, policies, search
from autopolicy.nn import _partition
from autopolicy.numerics import float8, int8
from autopolicy.search import solver, timing

FLOAT32 = "float32"
MODELS = ("digits_mlp", "digits_cnn", "text_transformer")
ORACLE_MODELS = ("digits_mlp",)


def config_key(assignment: dict[str, str]) -> str:
    """One string per configuration: its non-float32 layers, sorted."""
    return json.dumps(sorted((k, v) for k, v in assignment.items() if v != FLOAT32))


class Counter:
    """Counts full-model evaluations (with a memo, so re-testing a configuration is free)."""

    def __init__(self, exp: experiment.Experiment, base: Any):
        self.exp, self.base, self.count, self.memo = exp, base, 0, {}

    def metric(self, assignment: dict[str, str]) -> float:
        key = config_key(assignment)
        if key not in self.memo:
            self.count += 1
            self.memo[key] = float(self.exp.eval_fn(model_for(self.base, assignment, self.exp)))
        return self.memo[key]


def model_for(base: Any, assignment: dict[str, str], exp: experiment.Experiment) -> Any:
    entries = {k: v for k, v in assignment.items() if v != FLOAT32}
    model = base.with_dtype_policy(policies.DTypePolicyMap(FLOAT32, entries))
    if any(v.startswith("float8") for v in entries.values()):
        from autopolicy.nn import calibrate  # pylint: disable=import-outside-toplevel

        model = calibrate(model, [b if isinstance(b, tuple) else (b,) for b in (exp.calibration_inputs or [exp.sample_input])])
    return model


# --- strategies -------------------------------------------------------------------------------


def fastest(profile) -> dict[str, str]:
    """Each layer's fastest policy whose output stayed finite."""
    ok = profile[profile["finite_output"]]
    return {layer: rows.loc[rows["latency_s"].idxmin(), "policy"] for layer, rows in ok.groupby("layer", sort=False)}


def harm(profile, layer: str, policy: str) -> float:
    row = profile[(profile["layer"] == layer) & (profile["policy"] == policy)]
    value = float(row["accuracy_cost"].iloc[0]) if len(row) else math.nan
    return math.inf if math.isnan(value) else value  # unmeasured: treat as the most harmful


def greedy_fallback(profile, counter: Counter, min_metric: float) -> dict[str, str]:
    config = fastest(profile)
    order = sorted((l for l, p in config.items() if p != FLOAT32), key=lambda l: -harm(profile, l, config[l]))
    while counter.metric(config) < min_metric and order:
        config[order.pop(0)] = FLOAT32
    return config


def bisection(profile, counter: Counter, min_metric: float) -> dict[str, str]:
    low = fastest(profile)
    layers = [l for l in low if low[l] != FLOAT32]
    accepted: list[str] = []

    def config(extra):
        return {l: (low[l] if l in accepted or l in extra else FLOAT32) for l in low}

    def visit(block):
        if not block:
            return
        if counter.metric(config(block)) >= min_metric:
            accepted.extend(block)
        elif len(block) > 1:
            visit(block[: len(block) // 2])
            visit(block[len(block) // 2 :])

    visit(layers)
    return config([])


def _perturbation(kernel: jax.Array, policy: str) -> float:
    w = jnp.asarray(kernel, jnp.float32)
    if policy.startswith("int8"):
        axes = tuple(range(w.ndim - 1))
        q, s = int8.quantize_symmetric(w, axes)
        approx = q.astype(jnp.float32) * s
    elif policy.startswith("float8"):
        amax = jnp.max(jnp.abs(w))
        approx = float8.quantize_dequantize(w, amax / float8.E4M3_MAX, float8.E4M3)
    else:
        approx = w.astype(policies.get(policy).compute_dtype).astype(jnp.float32)
    return float(jnp.sum((approx - w) ** 2))


def hessian_traces(base: Any, loss_fn: Callable[[Any], jax.Array], samples: int = 8) -> dict[str, float]:
    """Hutchinson's estimate of each layer kernel's Hessian trace divided by its size."""
    params, rest = _partition.partition(base, "param")
    grad = jax.grad(lambda p: loss_fn(_partition.combine(p, rest)))

    @jax.jit
    def vhv(params, key):
        leaves, treedef = jax.tree_util.tree_flatten(params)
        keys = jax.random.split(key, len(leaves))
        v = treedef.unflatten([jax.random.rademacher(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
        _, hv = jax.jvp(grad, (params,), (v,))
        return jax.tree_util.tree_map(lambda a, b: jnp.sum(a * b), v, hv)

    totals = None
    for i in range(samples):
        est = vhv(params, jax.random.key(i))
        totals = est if totals is None else jax.tree_util.tree_map(jnp.add, totals, est)
    traced = _partition.combine(totals, jax.tree_util.tree_map(lambda x: None, rest))
    out = {}
    for path, layer in traced.layers_by_path().items():
        kernel = getattr(layer, "kernel", None)
        if kernel is not None:
            out[path] = float(kernel) / samples / base.layers_by_path()[path].kernel.size
    return out


def hawq_proxy(profile, base, counter: Counter, loss_fn, budget: float, baseline: float) -> dict[str, str]:
    traces = hessian_traces(base, loss_fn)
    layers = []
    for layer, rows in profile.groupby("layer", sort=False):
        # HAWQ perturbs weights only: a layer without a kernel (a norm, the attention core) costs 0.
        kernel = getattr(base.layers_by_path()[layer], "kernel", None)
        options = []
        for _, r in rows[rows["finite_output"]].iterrows():
            weighted = r["policy"] != FLOAT32 and kernel is not None
            omega = traces.get(layer, 0.0) * _perturbation(kernel, r["policy"]) if weighted else 0.0
            options.append(solver.Option(r["policy"], r["compute_dtype"], r["latency_s"], max(omega, 0.0)))
        layers.append(solver.Layer(layer, tuple(options), chained=False))
    all_fast = solver.solve(layers, math.inf)
    low = {l.name: min(l.options, key=lambda o: o.latency) for l in layers}
    omega_all = sum(o.accuracy_cost for o in low.values())
    drop_all = baseline - counter.metric({k: o.policy for k, o in low.items()})
    scale = omega_all / drop_all if drop_all > 0 else math.inf
    solution = solver.solve(layers, budget * scale) or all_fast
    return solution.policies(layers)


# --- the benchmark ----------------------------------------------------------------------------


def loss_for(name: str, exp: experiment.Experiment) -> Callable[[Any], jax.Array]:
    """The training loss on validation data (what the Hessian is taken of)."""
    from autopolicy import datasets, train  # pylint: disable=import-outside-toplevel

    if name.startswith("digits"):
        data = datasets.digits(seed=0, image=name == "digits_cnn")
        x, y = jnp.asarray(data.x_val), jnp.asarray(data.y_val)
    else:
        module = experiment.load(name)
        _, held_out = datasets.python_source_bytes(num_bytes=2_000_000, seed=0)
        xv, yv = module.windows(held_out[: len(held_out) // 2], 128, seed=2)
        x, y = jnp.asarray(xv), jnp.asarray(yv)
    return lambda m: train.losses.sparse_categorical_crossentropy(y, m(x))


def oracle(profile, counter: Counter, min_metric: float, base, exp, repeats: int) -> dict[str, str]:
    """Every combination scored end to end; those within budget timed end to end (interleaved),
    and the fastest eight timed again with more repetitions (a single noisy round would favour
    whichever combination happened to be lucky)."""
    choices = {layer: list(rows[rows["finite_output"]]["policy"]) for layer, rows in profile.groupby("layer", sort=False)}
    combos = [dict(zip(choices, c)) for c in itertools.product(*choices.values())]
    passing = {json.dumps(c): c for c in combos if counter.metric(c) >= min_metric}
    args = exp.sample_input if isinstance(exp.sample_input, tuple) else (exp.sample_input,)

    def timed(keys, n):
        return timing.measure({k: timing.Candidate(lambda m, *a: m(*a), args, model_for(base, passing[k], exp))
                               for k in keys}, repeats=n)

    first = timed(list(passing), repeats)
    finalists = sorted(passing, key=lambda k: first[k].median)[:8]
    second = timed(finalists, 4 * repeats)
    return passing[min(finalists, key=lambda k: second[k].median)]


def run_model(name: str, out_dir: str, repeats: int) -> dict[str, Any]:
    exp_module = experiment.load(name)
    exp = exp_module.build(experiment.default_cache_dir())
    if not exp.higher_is_better:  # the peer strategies below compare metrics upwards only
        raise ValueError(f"bench_search compares strategies on higher-is-better metrics; {name!r} states "
                         "higher_is_better=False")
    run_dir = os.path.join(out_dir, name)
    cache_dir = os.path.join(run_dir, "cache")
    shutil.rmtree(cache_dir, ignore_errors=True)  # the tuner's evaluations and wall time, from scratch
    kwargs = dict(candidates=exp.candidates, max_drop=exp.max_drop, relative=exp.relative, cache_dir=cache_dir,
                  calibration_inputs=exp.calibration_inputs, repeats=repeats, progress=False)
    start = time.perf_counter()
    result = search.tune(exp.model, exp.eval_fn, exp.sample_input, **kwargs)
    tune_wall = time.perf_counter() - start
    result.save(run_dir)
    s = result.summary
    # The peers' shared tables: the same latencies (from the cache) and every layer's accuracy cost.
    profile = search.tune(exp.model, exp.eval_fn, exp.sample_input, profile_accuracy="always", **kwargs).profile
    baseline, budget = s["budget"]["baseline_metric"], s["budget"]["allowed_drop"]
    min_metric = baseline - budget
    base = exp.model.with_dtype_policy(FLOAT32)
    configs: dict[str, dict] = {}
    for policy in exp.candidates:
        assignment = {l: (policy if policy in set(rows["policy"]) else FLOAT32)
                      for l, rows in profile.groupby("layer", sort=False)}
        configs[f"uniform {policy}"] = {"assignment": assignment, "evaluations": 0 if policy == FLOAT32 else 1,
                                        "wall_s": 0.0}
    tuner = {row["layer"]: row["policy"] for _, row in result.profile[result.profile["chosen"]].iterrows()}
    evaluations = s["evaluations"]
    configs["autopolicy tune"] = {"assignment": tuner, "evaluations": evaluations["profile"] + evaluations["verify"],
                                  "report_evaluations": evaluations["report_only"], "wall_s": tune_wall,
                                  "accuracy_profile": s["accuracy_profile"]}
    strategies = {
        "greedy fallback (INC basic)": lambda c: greedy_fallback(profile, c, min_metric),
        "bisection (ORT AMP)": lambda c: bisection(profile, c, min_metric),
        "HAWQ-V3 proxy": lambda c: hawq_proxy(profile, base, c, loss_for(name, exp), budget, baseline),
    }
    if name in ORACLE_MODELS:
        strategies["exhaustive oracle"] = None
    for label, strategy in strategies.items():
        counter, t0 = Counter(exp, base), time.perf_counter()
        if strategy is None:
            assignment = oracle(profile, counter, min_metric, base, exp, repeats)
        else:
            assignment = strategy(counter)
        configs[label] = {"assignment": assignment, "evaluations": counter.count, "wall_s": time.perf_counter() - t0}
    return finish(name, exp, base, configs, baseline, budget, repeats)


def finish(name, exp, base, configs, baseline, budget, repeats) -> dict[str, Any]:
    """Times every strategy's final model together and scores each on validation and test."""
    # Strategies that reach the same configuration share one model and one timing: the same
    # model timed twice differs only by noise, which must not rank the strategies.
    distinct: dict[str, Any] = {}
    for c in configs.values():
        if config_key(c["assignment"]) not in distinct:
            distinct[config_key(c["assignment"])] = model_for(base, c["assignment"], exp)
    models = {label: distinct[config_key(c["assignment"])] for label, c in configs.items()}
    args = exp.sample_input if isinstance(exp.sample_input, tuple) else (exp.sample_input,)
    timed = timing.measure({k: timing.Candidate(lambda m, *a: m(*a), args, m) for k, m in distinct.items()},
                           repeats=3 * repeats)
    times = {label: timed[config_key(c["assignment"])] for label, c in configs.items()}
    test_base = exp.test_fn(base) if exp.test_fn else math.nan
    rows = []
    for label, c in configs.items():
        val = float(exp.eval_fn(models[label]))
        test = float(exp.test_fn(models[label])) if exp.test_fn else math.nan
        rows.append({
            "model": name, "strategy": label, "latency_s": times[label].median, "latency_cv": times[label].cv,
            "val_drop": baseline - val, "test_drop": test_base - test, "budget_held": baseline - val <= budget + 1e-12,
            "evaluations": c["evaluations"], "report_evaluations": c.get("report_evaluations", 0),
            "wall_s": c["wall_s"], "changed": sum(1 for v in c["assignment"].values() if v != FLOAT32),
            "assignment": {k: v for k, v in c["assignment"].items() if v != FLOAT32},
        })
    f32 = next(r["latency_s"] for r in rows if r["strategy"] == "uniform float32")
    oracle_row = next((r for r in rows if r["strategy"] == "exhaustive oracle"), None)
    for r in rows:
        r["speedup_vs_float32"] = f32 / r["latency_s"]
        r["ratio_to_oracle"] = r["latency_s"] / oracle_row["latency_s"] if oracle_row else math.nan
    return {"model": name, "budget": budget, "baseline": baseline, "rows": rows}


def _changes(assignment: dict[str, str]) -> str:
    """'2 int8_from_float32, 1 mixed_bfloat16' (none: every layer float32)."""
    counts: dict[str, int] = {}
    for policy in assignment.values():
        counts[policy] = counts.get(policy, 0) + 1
    return ", ".join(f"{n} {p}" for p, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"


def markdown(results: list[dict], device: str, command: str, figure: str) -> str:
    lines = [
        "# Benchmark: the tuner against its peers' strategies",
        "",
        f"Device: {device}. Command: `{command}`.",
        "",
        "The tuner runs as shipped (`autopolicy.search.tune` with its defaults), from an empty cache: its "
        "*evaluations* are every full-model evaluation it needed to decide (per-layer accuracy costs, when the "
        "fastest assignment breaks the budget, and verification), and its wall time is the whole run; uniform "
        "policies it scored only for its report are listed in brackets. The other strategies are handed the "
        "tuner's per-layer latency table and a complete per-layer accuracy table for free (not counted); their "
        "evaluations are their own full-model evaluations of the validation metric. All strategies have the same "
        "budget (a 1% relative drop of the validation metric). Their final models are timed end to end together, "
        "interleaved (strategies that reach the same configuration share one timing), and scored on validation "
        "(the budget) and on held-out test data.",
        "",
        f"![speedups]({figure})",
        "",
    ]
    for res in results:
        lines += [f"## {res['model']}", "",
                  f"float32 validation metric {res['baseline']:.4f}; allowed drop {res['budget']:.4f}.", "",
                  "| strategy | latency (ms) | x float32 | / oracle | val drop | test drop | budget held | "
                  "evaluations | layers changed (by policy) | wall (s) |",
                  "|---|---:|---:|---:|---:|---:|:---:|---:|---:|---:|"]
        for r in sorted(res["rows"], key=lambda r: r["latency_s"]):
            oracle = "" if math.isnan(r["ratio_to_oracle"]) else f"{r['ratio_to_oracle']:.3f}"
            evals = f"{r['evaluations']}" + (f" (+{r['report_evaluations']} for the report)"
                                             if r["report_evaluations"] else "")
            test = "" if math.isnan(r["test_drop"]) else f"{r['test_drop']:+.4f}"
            lines.append(f"| {r['strategy']} | {1e3 * r['latency_s']:.3f} | {r['speedup_vs_float32']:.2f} | {oracle} | "
                         f"{r['val_drop']:+.4f} | {test} | {'yes' if r['budget_held'] else 'NO'} | {evals} | "
                         f"{_changes(r['assignment'])} | {r['wall_s']:.1f} |")
        lines.append("")
    lines += ["## Targets", ""] + targets(results)
    return "\n".join(lines) + "\n"


def targets(results: list[dict]) -> list[str]:
    out = []
    for res in results:
        rows = {r["strategy"]: r for r in res["rows"]}
        tuner = rows["autopolicy tune"]
        if "exhaustive oracle" in rows:
            gap = tuner["latency_s"] / rows["exhaustive oracle"]["latency_s"] - 1
            out.append(f"- {res['model']}: tuner vs oracle latency {100 * gap:+.1f}% (target within +3%): "
                       f"{'met' if gap <= 0.03 else 'missed'}.")
        rivals = [r for k, r in rows.items() if k not in ("autopolicy tune", "exhaustive oracle") and r["budget_held"]]
        faster = [r["strategy"] for r in rivals if r["latency_s"] < tuner["latency_s"] * 0.99]
        out.append(f"- {res['model']}: strategies meeting the budget faster than the tuner by more than 1%: "
                   f"{faster or 'none'}.")
        greedy = rows["greedy fallback (INC basic)"]["evaluations"]
        verdict = ("met" if 5 * tuner["evaluations"] <= greedy else "missed") if res["model"] == "text_transformer" \
            else "no target on this model"
        out.append(f"- {res['model']}: tuner evaluations {tuner['evaluations']} vs greedy fallback {greedy} "
                   f"(target <= 1/5 on text_transformer): {verdict}.")
    return out


def figure(results: list[dict], path: str) -> None:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    strategies = [r["strategy"] for r in results[0]["rows"] if not r["strategy"].startswith("uniform")]
    strategies += sorted({r["strategy"] for res in results for r in res["rows"] if r["strategy"].startswith("uniform")})
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / len(strategies)
    cmap = plt.get_cmap("tab10")
    for j, name in enumerate(strategies):
        for i, res in enumerate(results):
            row = next((r for r in res["rows"] if r["strategy"] == name), None)
            if row is None:
                continue
            ax.bar(i + j * width, row["speedup_vs_float32"], width, color=cmap(j % 10),
                   hatch=None if row["budget_held"] else "//", edgecolor="black", linewidth=0.4,
                   label=name if i == 0 or name == "exhaustive oracle" else None)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], [r["model"] for r in results])
    ax.set_ylabel("end-to-end speed-up vs float32")
    ax.set_title("Strategies at a 1% accuracy budget (hatched: budget broken)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=150)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


def json_safe(value: Any) -> Any:
    """NaN (no oracle for this model, no test data) becomes null in the JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    if isinstance(value, (np.bool_, np.integer, np.floating)):
        return value.item()
    return value


def _default_out() -> str:
    """``reports/search-<machine-class>.md``, the class named as the kernel benchmarks name it."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_kernels import device_slug  # pylint: disable=import-outside-toplevel

    from autopolicy.numerics.device import current_device, read_cpuinfo  # pylint: disable=import-outside-toplevel

    return os.path.join("reports", f"search-{device_slug(current_device(), read_cpuinfo()[0])}.md")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--out", default=None, help="default: reports/search-<machine-class>.md")
    parser.add_argument("--runs", default="runs/benchmark", help="where each model's tuning run (and cache) goes")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    args.out = args.out or _default_out()
    results = []
    for name in args.models:
        print(f"== {name}", file=sys.stderr)
        results.append(run_model(name, args.runs, args.repeats))
        _atomic.write_json(os.path.splitext(args.out)[0] + ".json", json_safe(results))  # survives a crash
    device = search.hardware.describe()
    command = "python benchmarks/bench_search.py " + " ".join(argv if argv is not None else sys.argv[1:])
    png = os.path.splitext(args.out)[0] + ".png"
    figure(results, png)
    text = markdown(results, device, command.strip(), os.path.basename(png))
    _atomic.write_text(args.out, text)
    _atomic.write_json(os.path.splitext(args.out)[0] + ".json", json_safe(results))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
