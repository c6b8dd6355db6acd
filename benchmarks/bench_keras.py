"""Benchmark: a Keras 3 model tuned by autopolicy against Keras's own ``model.quantize("int8")``
and float32, timed side by side on this machine.

The ``keras_text`` experiment (a Keras byte-level transformer) is tuned with
``autopolicy.search.tune`` (or its map read from ``--map``). Three models, all Keras, run the same
sample batch: float32, a copy quantized by Keras (every Dense, EinsumDense and Embedding int8, the
MultiHeadAttention projections included), and the tuned copy. Each is one jitted program (Keras's
own ``__call__`` inside ``jax.jit``, weights as arguments) timed by
``autopolicy.search.timing.measure``: warmed up, amortized over many calls, the three interleaved
in a random order each round, medians. Accuracy is next-byte accuracy on the validation windows
(the tuner's budget) and on separate held-out test windows.

Usage::

    python benchmarks/bench_keras.py --out reports/keras-<machine-class>.md   # tunes, then times
    python benchmarks/bench_keras.py --map runs/keras_text/policy_map.json --repeats 5
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
import warnings

import autopolicy.keras as apk
import jax
import numpy as np

from autopolicy import _atomic, experiment, policies, search
from autopolicy.adapters import _keras_layers
from autopolicy.search import hardware, timing

EXPERIMENT = "keras_text"


def keras_int8(model):
    """A copy of ``model`` quantized by Keras itself (``model.quantize("int8")``)."""
    copy = apk.apply_policy_map(model, policies.DTypePolicyMap("float32"))
    with warnings.catch_warnings(), _keras_layers.quiet_numpy_conversion():
        warnings.filterwarnings("ignore", message=".*does not have a `quantize` method", category=UserWarning)
        copy.quantize("int8")
    return copy


def weight_bytes(model) -> int:
    return int(sum(np.asarray(v.value).nbytes for v in model.weights))


def policy_counts(model) -> str:
    counts: dict[str, int] = {}
    for layer in model._flatten_layers(include_self=False):
        if _keras_layers.is_tunable(layer):
            name = _keras_layers.own_policy(layer).name
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} x{c}" for n, c in sorted(counts.items(), key=lambda item: -item[1]))


def candidate(model, x) -> timing.Candidate:
    call = _keras_layers.stateless_fn(model)
    return timing.Candidate(lambda state, a: call(state, (a,), {}), (jax.numpy.asarray(x),),
                            _keras_layers.state_of(model))


def tuned_model(exp, args) -> tuple:
    if args.map:
        policy_map = policies.load_policy_map(args.map)
        return apk.apply_policy_map(exp.model, policy_map, calibration_inputs=exp.calibration_inputs), policy_map, None
    result = search.tune(exp.model, exp.eval_fn, exp.sample_input, calibration_inputs=exp.calibration_inputs,
                         test_fn=exp.test_fn, max_drop=exp.max_drop, repeats=args.tune_repeats,
                         cache_dir=os.path.join(args.run_dir, "cache"), progress=sys.stderr.isatty())
    result.save(args.run_dir)
    return result.model, result.policy_map, result


def markdown(rows: list[dict], command: str, seconds: float, tune_note: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    info = hardware.detect()
    lines = [
        "# Keras 3: autopolicy's tuned map vs Keras's own int8 vs float32",
        "",
        f"Produced by `{command}` on {now} in {seconds:.0f} s.",
        "",
        f"- device: {hardware.describe(info)}",
        f"- CPU features seen: {', '.join(info['cpu']['features']) or 'none of those autopolicy checks'}",
        f"- keras {apk.keras.__version__} (backend {apk.keras.backend.backend()}), jax {jax.__version__}",
        "",
        "Model: `experiments/keras_text.py`, a Keras Functional byte-level transformer (Embedding, learned "
        "positions, 2 pre-norm blocks of LayerNormalization + causal MultiHeadAttention + GELU Dense MLP, "
        "width 128), batch 32 x 64 bytes. Latency: median seconds per call of the whole model, jitted "
        "(Keras's own layers inside `jax.jit`), the three models interleaved in random order each round by "
        "`autopolicy.search.timing.measure`; `cv` is the robust coefficient of variation. Accuracy: "
        "next-byte accuracy on 256 validation windows (the tuner's budget: at most 1% relative drop) and on "
        "256 held-out test windows from other files.",
        "",
        tune_note,
        "",
        "| model | tunable layers' policies | median ms | cv | speed-up vs float32 | val accuracy | test accuracy "
        "| weight bytes |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = rows[0]["median"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['policies']} | {1e3 * r['median']:.3f} | {r['cv']:.2f} | "
                     f"{base / r['median']:.2f}x | {r['val']:.4f} | {r['test']:.4f} | {r['bytes']:,} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the markdown report here (default: print it)")
    parser.add_argument("--map", default=None, help="use this policy map instead of tuning")
    parser.add_argument("--run-dir", default=os.path.join("runs", EXPERIMENT), help="the tuning run's directory")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds of the three models")
    parser.add_argument("--tune-repeats", type=int, default=20, help="the tuner's timing repetitions per layer")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    exp = experiment.load(EXPERIMENT).build(experiment.default_cache_dir())
    tuned, policy_map, result = tuned_model(exp, args)
    if result is None:
        tune_note = f"The tuned map was read from `{args.map}`."
    else:
        tune_note = (f"The tuned map (`{args.run_dir}/policy_map.json`) was chosen by `autopolicy.search.tune` in "
                     f"{result.wall_time_s:.0f} s with {result.evaluations['total']} evaluations; it changes "
                     f"{len(policy_map)} layers.")
    models = {"float32": exp.model, "Keras model.quantize('int8')": keras_int8(exp.model), "autopolicy tuned": tuned}
    timings = timing.measure({name: candidate(m, exp.sample_input) for name, m in models.items()},
                             repeats=args.repeats)
    rows = [{"name": name, "policies": policy_counts(m), "median": timings[name].median, "cv": timings[name].cv,
             "val": exp.eval_fn(m), "test": exp.test_fn(m), "bytes": weight_bytes(m)} for name, m in models.items()]
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_keras.py"] + list(argv or sys.argv[1:]))
    text = markdown(rows, command, time.perf_counter() - start, tune_note)
    if args.out:
        _atomic.write_text(args.out, text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
