"""Do the tuner's decisions survive noise? Three tunes from empty caches, then an independent timing.

Tunes one experiment ``--runs`` times, each from an empty measurement cache, then times the maps
they chose, float32 and every uniform policy together, in paired interleaved rounds in one
compiled session (nothing reused from the tunes), and reports: each map's speed-up over float32
with its 95% interval, as the tuner claimed it and as timed independently; how well the maps'
independent latencies agree; and the calibrated latency model's prediction against the
independent timing.

Goals (issue 16): a tuned map is never slower than float32 by more than 1%; the maps' latencies
agree within 3%; predicted within 15% of measured.

Run: ``python benchmarks/bench_repro.py digits_mlp --out reports/repro-digits_mlp-<machine-class>.md``
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time

import numpy as np

from autopolicy import _atomic, experiment, policies, search
from autopolicy.search import confidence, hardware, timing
from autopolicy.search.adapter import get_adapter


def _tune(exp, repeats: int, progress: bool) -> search.TuneResult:
    with tempfile.TemporaryDirectory() as cache:
        return search.tune(exp.model, exp.eval_fn, exp.sample_input, candidates=exp.candidates or search.DEFAULT_CANDIDATES,
                           max_drop=exp.max_drop, relative=exp.relative, higher_is_better=exp.higher_is_better,
                           cache_dir=cache, progress=progress,
                           calibration_inputs=exp.calibration_inputs, repeats=repeats)


def _independent(exp, configs: dict[str, policies.DTypePolicyMap], rounds: int) -> dict[str, list[float]]:
    """Per-round seconds of every configuration, all timed together in paired rounds."""
    args = exp.sample_input if isinstance(exp.sample_input, tuple) else (exp.sample_input,)
    calibration = [b if isinstance(b, tuple) else (b,) for b in (exp.calibration_inputs or [args])]
    adapter = get_adapter(exp.model, args, calibration)
    todo, seen = {}, {}
    for name, policy_map in configs.items():
        k = json.dumps(policies.serialize(policy_map), sort_keys=True)
        if k in seen:  # the same model: one timing serves both names
            continue
        seen[k] = name
        program = adapter.model_program(adapter.with_policies(policy_map))
        todo[name] = timing.Candidate(program.fn, program.args, program.state)
    timer = timing.Timer(todo, seed=1234)
    timer.rounds(rounds)
    aliases = {name: seen[json.dumps(policies.serialize(m), sort_keys=True)] for name, m in configs.items()}
    return {name: timer.samples[alias] for name, alias in aliases.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", nargs="?", default="digits_mlp")
    parser.add_argument("--runs", type=int, default=3, help="independent tunes from empty caches")
    parser.add_argument("--repeats", type=int, default=20, help="the tuner's timing repetitions")
    parser.add_argument("--rounds", type=int, default=60, help="rounds of the independent timing")
    parser.add_argument("--out", default=None, help="write the markdown report here (and a .json beside it)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    exp = experiment.load(args.experiment).build(experiment.default_cache_dir())

    results, walls = [], []
    for i in range(args.runs):
        start = time.perf_counter()
        results.append(_tune(exp, args.repeats, not args.no_progress))
        walls.append(time.perf_counter() - start)
        print(f"tune {i + 1}: {results[-1].chosen.name}, {results[-1].summary['speedup_vs_float32']:.3f}x float32 "
              f"({walls[-1]:.0f} s)", file=sys.stderr)
    configs = {f"tune {i + 1}: {r.chosen.name}": r.policy_map for i, r in enumerate(results)}
    float32 = results[0].configurations[[c.kind == "uniform" and c.uniform == "float32"
                                         for c in results[0].configurations].index(True)]
    configs["uniform float32"] = float32.policy_map
    for c in results[0].configurations:
        if c.kind == "uniform" and c.uniform != "float32":
            configs[c.name] = c.policy_map
    samples = _independent(exp, configs, args.rounds)
    ref = samples["uniform float32"]

    rows = []
    for name, values in samples.items():
        s = confidence.paired_speedup(ref, values)
        row = {"configuration": name, "median_ms": 1e3 * float(np.median(values)),
               "speedup": s.median, "low": s.low, "high": s.high, "rounds": s.rounds}
        if name.startswith("tune "):
            r = results[int(name.split(":")[0].split()[1]) - 1]
            row.update(claimed=r.summary["speedup_vs_float32"], claimed_interval=r.summary.get(
                "speedup_vs_float32_interval"), calibrated_ms=1e3 * (r.chosen.calibrated_latency_s or float("nan")),
                predicted_ms=1e3 * r.chosen.predicted_latency_s, changed=len(r.chosen.changed))
        rows.append(row)
    tuned = [r for r in rows if r["configuration"].startswith("tune ")]
    medians = [r["median_ms"] for r in tuned]
    agreement = max(medians) / min(medians) - 1
    worst = min(r["speedup"] for r in tuned)
    prediction_errors = [abs(r["calibrated_ms"] / r["median_ms"] - 1) for r in tuned]
    verdicts = [
        f"- Slowest tuned map vs float32, timed independently: {worst:.3f}x "
        f"(goal: never slower than float32 by more than 1%, i.e. >= 0.99x): {'met' if worst >= 0.99 else 'MISSED'}.",
        f"- The {len(tuned)} maps' independent latencies agree within {100 * agreement:.1f}% "
        f"(goal <= 3%): {'met' if agreement <= 0.03 else 'MISSED'}.",
        f"- Calibrated prediction vs independent timing, worst: {100 * max(prediction_errors):.1f}% "
        f"(goal <= 15%): {'met' if max(prediction_errors) <= 0.15 else 'MISSED'}.",
    ]
    command = shlex.join(["python", "benchmarks/bench_repro.py"] + (sys.argv[1:] if argv is None else list(argv)))
    lines = [
        f"# Reproducibility of tuned maps: {exp.name}", "",
        f"Device: {hardware.describe()}.", f"Command: `{command}`.", "",
        f"{args.runs} tunes from empty caches (tuner repeats {args.repeats}; wall "
        f"{', '.join(f'{w:.0f} s' for w in walls)}), then every configuration below timed together, "
        f"{args.rounds} paired interleaved rounds in one compiled session. Speed-ups are medians of per-round "
        "ratios to float32 with 95% bootstrap intervals.", "",
        "| configuration | median ms | speed-up vs float32 (independent) | tuner's claim | changed layers "
        "| predicted ms (sum) | calibrated ms |", "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        claim = "—"
        if "claimed" in r:
            interval = r.get("claimed_interval")
            claim = f"{r['claimed']:.3f}x" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")
        lines.append(
            f"| {r['configuration']} | {r['median_ms']:.3f} | {r['speedup']:.3f}x [{r['low']:.3f}, {r['high']:.3f}] "
            f"| {claim} | {r.get('changed', '—')} | "
            + (f"{r['predicted_ms']:.3f} | {r['calibrated_ms']:.3f} |" if "claimed" in r else "— | — |"))
    lines += ["", "## Verdict", ""] + verdicts + ["", "Noise seen by the tunes:", ""]
    for i, r in enumerate(results, 1):
        seen = r.summary.get("noise", {})
        lines.append(f"- tune {i}: {seen.get('note', 'not recorded')}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        _atomic.write_text(args.out, text)
        _atomic.write_json(args.out.rsplit(".", 1)[0] + ".json", {"rows": rows, "walls_s": walls,
                                                                  "device": hardware.describe()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
