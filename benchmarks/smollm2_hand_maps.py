"""Hand-written SmolLM2-135M maps beside the uniform ones: int8 (int8 activations, the fastest
8-bit path) everywhere uniform int8 reaches except the projection kinds named, which keep
weight-only gptq/8. What a
tune's map should be compared with: where these land shows how much of the speed-perplexity
trade-off is left to the solver and how much to the kernels.

    .venv/bin/python benchmarks/smollm2_hand_maps.py [--gptq8 value,head value,head,down ...]
        [--tuned runs/smollm2 ...] [--reps 15]

``--tuned`` adds tune runs' chosen maps (with the kernels their tunes chose) to the same run;
``--every-map`` adds every map those runs verified (``frontier.csv``) instead of the chosen one.

Perplexity is the held-out split's (the tune's ``test_fn``); decode is one step at batch 1 and
cache ``smollm2.CACHE``, every configuration interleaved, as in ``report_smollm2.py`` (whose
calibration and timing it reuses); speed-ups are medians of per-round ratios to float32
[quartiles]. Prints one line per configuration; writes nothing.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent / "experiments")]  # the other benchmarks; the tasks
import report_smollm2  # noqa: E402
import smollm2  # noqa: E402

import autopolicy as ap  # noqa: E402
from autopolicy.nn import generation  # noqa: E402
from autopolicy.search import hardware  # noqa: E402

GPTQ8, INT8 = "gptq/8/-1_from_float32", "int8_from_float32"
KINDS = ("query", "key", "value", "attention_output", "gate", "up", "down", "head")


def hand_map(model, kept: tuple[str, ...]) -> dict[str, str]:
    """Every projection, the head and the embedding on int8 (as uniform int8 has them), the
    projections whose last path part is in ``kept`` on gptq/8."""
    unknown = sorted(set(kept) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown projection kinds {unknown}; valid: {list(KINDS)}")
    paths = [p for p in model.layers_by_path() if p.rsplit("/", 1)[-1] in KINDS + ("embedding",)]
    return {p: GPTQ8 if p.rsplit("/", 1)[-1] in kept else INT8 for p in paths}


def verified_maps(run: pathlib.Path) -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    """``{name: (policies, kernels)}`` of every map a tune run verified (``frontier.csv``'s
    measured maps), each layer on the kernel the run's profile kept for its policy."""
    import csv  # pylint: disable=import-outside-toplevel
    import json  # pylint: disable=import-outside-toplevel

    with open(run / "profile.csv", newline="") as f:
        kept = {(row["layer"], row["policy"]): row["kernel"] for row in csv.DictReader(f) if row.get("kernel")}
    out = {}
    with open(run / "frontier.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["source"] == "measured" and row["name"].startswith("map"):
                chosen = json.loads(row["policies"])
                out[row["name"]] = (chosen, {p: kept[p, n] for p, n in chosen.items() if (p, n) in kept})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gptq8", nargs="+", default=["value,head", "value,key,head", "value,head,down"],
                        help="comma-separated projection kinds kept on gptq/8, one map each")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--tuned", type=pathlib.Path, nargs="*", default=[],
                        help="`autopolicy tune smollm2` run directories whose chosen maps to time beside")
    parser.add_argument("--every-map", action="store_true",
                        help="with --tuned: every map the runs verified, not only the chosen one")
    args = parser.parse_args(argv)
    model, _, tok = smollm2.load()
    heldout = smollm2.windows(tok, "heldout")
    batches = report_smollm2.calibration_batches(tok)
    specs = {"float32": None, INT8: INT8, GPTQ8: GPTQ8}
    for kinds in args.gptq8:
        kept = tuple(k.strip() for k in kinds.split(",") if k.strip())
        specs[f"int8, gptq/8 on {'+'.join(kept)}"] = ap.DTypePolicyMap("float32", hand_map(model, kept))
    kernels = {}
    for run in args.tuned:
        for name, (chosen, chosen_kernels) in (verified_maps(run) if args.every_map else
                                               {"tuned": report_smollm2.tuned_from_run(run)[:2]}).items():
            kernels[f"{name} ({run.name})"] = chosen_kernels
            specs[f"{name} ({run.name})"] = ap.DTypePolicyMap("float32", chosen)
    models, ppl, cache = {}, {}, {}
    for name, policy in specs.items():
        built = model if policy is None else report_smollm2.with_kernels(
            report_smollm2.calibrated(model.with_dtype_policy(policy), model, batches, cache), kernels.get(name))
        models[name] = built
        ppl[name] = generation.perplexity(built, heldout, smollm2.BATCH)
    timings = report_smollm2.time_decode(models, smollm2.CACHE, args.reps, args.inner)
    print(f"{hardware.describe()}; decode step, batch 1, cache {smollm2.CACHE}, {args.reps} interleaved rounds")
    base = timings["float32"]
    for name, s in timings.items():
        r = base / s
        print(f"{name:40s} perplexity {ppl[name]:7.3f} ({100 * (ppl[name] / ppl['float32'] - 1):+.2f}%) "
              f"{models[name].nbytes() / 1e6:6.1f} MB  "
              f"{np.median(s) * 1e3:6.2f} ms  x{np.median(r):.2f} [{np.percentile(r, 25):.2f}, {np.percentile(r, 75):.2f}]")


if __name__ == "__main__":
    main()
