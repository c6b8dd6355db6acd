"""Times a tune's chosen model against float32 end to end, in a process of its own: the check of
a tune's own speed-up figure, with nothing shared with the tune but its run directory.

The tuned model is the run's own (``autopolicy.load_tuned``: its policies, kernels and calibrated
weights as the tune chose them); the float32 model and the sample input come from the experiment
named in the run's ``summary.json``, built afresh. Both are timed in paired, interleaved rounds by
the package's timer (jit, warm-up, dependent calls, a fresh random order each round). Prints the
speed-up over float32 (the median of per-round ratios) with its 95% bootstrap interval, and the
device.

Run: ``python benchmarks/time_tuned.py runs/digits_mlp [--rounds 60]``
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import autopolicy
from autopolicy import experiment
from autopolicy.search import confidence, hardware, timing
from autopolicy.search.adapter import get_adapter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("run", type=pathlib.Path, help="a tune's run directory")
    parser.add_argument("--rounds", type=int, default=60, help="paired rounds (at least 3)")
    parser.add_argument("--cache-dir", default=None, help="the experiments' cache (datasets, models)")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error(f"--rounds must be at least 3; got {args.rounds}")
    summary_file = args.run / "summary.json"
    if not summary_file.is_file():
        parser.error(f"{args.run} is not a tune's run directory: it has no summary.json")
    summary = json.loads(summary_file.read_text())
    name = summary["experiment"]["name"]
    chosen = dict(summary["chosen"]["policies"])
    tuned = autopolicy.load_tuned(args.run)
    kernels = autopolicy._tuned.read_manifest(args.run)["kernels"]  # pylint: disable=protected-access

    exp = experiment.build(experiment.load(name), args.cache_dir)
    sample = exp.sample_input if isinstance(exp.sample_input, tuple) else (exp.sample_input,)
    adapter = get_adapter(exp.model, sample, [])  # only to time a model of its kind on the sample
    candidates = {}
    for label, model in (("float32", adapter.model), ("tuned", tuned)):
        program = adapter.model_program(model)
        candidates[label] = timing.Candidate(program.fn, program.args, program.state, carry=exp.step_carry)
    timer = timing.Timer(candidates, unroll=1)
    timer.rounds(args.rounds, list(candidates))
    speedup = confidence.paired_speedup(timer.samples["float32"], timer.samples["tuned"])
    changed = sum(1 for policy in chosen.values() if policy != "float32")
    f32_ms, tuned_ms = (1e3 * statistics.median(timer.samples[label]) for label in ("float32", "tuned"))
    print(f"device: {hardware.describe(hardware.detect())}")
    print(f"{name}: the tuned map ({changed} of {len(chosen)} layers changed, {len(kernels)} with a kernel chosen) "
          f"ran at {speedup.median:.3f}x [{speedup.low:.3f}, {speedup.high:.3f}] float32 over {speedup.rounds} "
          f"paired rounds ({tuned_ms:.3f} ms against {f32_ms:.3f} ms, medians)")
    print(f"the tune's own figure: {summary['speedup_vs_float32']:.3f}x "
          f"{[round(v, 3) for v in summary.get('speedup_vs_float32_interval') or []]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
