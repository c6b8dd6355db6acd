"""How well the first-order estimate ranks SmolLM2-135M's layers: estimated against measured
one-layer perplexity changes on a sample of layer/candidate pairs.

    .venv/bin/python benchmarks/bench_first_order.py [--windows 4] [--out reports/first-order-smollm2-<machine-class>.md]

1. The estimate for every tunable layer under every candidate (what ``tune`` computes with
   ``profile_accuracy="first_order"``): one forward and backward pass per calibration batch of
   the ``smollm2`` experiment, then each layer under each candidate on the inputs that pass
   recorded (``autopolicy.search.first_order``). Timed.
2. For a sample of pairs across layer kinds (query/key/value/output projections, gate/up/down,
   embedding, head) and candidates (int8, int4, int4/128), the measured change of the
   experiment's metric (the perplexity of 16 calibration-split windows) with only that layer
   changed, the rest float32.
3. Spearman rank correlation of each estimator (first-order term, Fisher term, their sum; and
   the layer output's SQNR, negated) with the measured changes: over all pairs, and within each
   candidate.

Measured perplexities are kept in ``--measured`` (JSON) so a rerun only measures new pairs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import sys
import time

import numpy as np

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent / "experiments")]  # the other benchmarks; the tasks
import smollm2  # noqa: E402

from autopolicy import policies  # noqa: E402
from autopolicy.search import first_order  # noqa: E402
from autopolicy.search.adapter import get_adapter  # noqa: E402
from autopolicy.search.cache import MeasurementCache  # noqa: E402

CANDIDATES = ("int8_from_float32", "int4_from_float32", "int4/128_from_float32")
KINDS = ("attention/query", "attention/key", "attention/value", "attention/attention_output",
         "mlp/gate", "mlp/up", "mlp/down")
BLOCKS = (0, 9, 19, 29)


def sample_pairs(paths: list[str]) -> list[tuple[str, str]]:
    """36 pairs: each projection kind in four blocks, the candidates taken in turn; the
    embedding and the head under each candidate; and two int8 projections more."""
    pairs = []
    turn = 0
    for kind in KINDS:
        for block in BLOCKS:
            path = next(p for p in paths if p.endswith(f"block_{block}/{kind}"))
            pairs.append((path, CANDIDATES[turn % len(CANDIDATES)]))
            turn += 1
    for name in ("embedding", "head"):
        path = next(p for p in paths if p.endswith(f"/{name}"))
        pairs += [(path, c) for c in CANDIDATES]
    return pairs[:36]


def spearman(x, y) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        v = np.asarray(v, float)
        order = np.argsort(v, kind="mergesort")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for value in np.unique(v):  # ties share their mean rank
            r[v == value] = r[v == value].mean()
        return r
    rx, ry = ranks(x), ranks(y)
    return float(np.corrcoef(rx, ry)[0, 1])


def _load_measured(path: str | None) -> dict:
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return {}


def _uptime() -> str:
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16,
                        help="calibration-split windows for the gradient (a multiple of 4: batches of 4)")
    parser.add_argument("--start", type=int, default=0,
                        help="the first of them: 0 for the 16 windows the metric scores (the experiment's "
                             "loss_inputs), 16 for windows disjoint from them")
    parser.add_argument("--measured", default="runs/bench_first_order/measured.json")
    parser.add_argument("--out", default=None, help="also write the table as Markdown here")
    args = parser.parse_args(argv)
    load_start = _uptime()
    exp = smollm2.build(None)
    model, _, tok = smollm2.load()
    calibration = smollm2.windows(tok, "calibration", None)
    first = args.start
    batches = [(calibration[i: i + smollm2.BATCH],) for i in range(first, first + args.windows, smollm2.BATCH)]
    adapter = get_adapter(exp.model, exp.sample_input, batches)
    paths = [layer.path for layer in adapter.layers()]
    pairs_all = [(l.path, policies.get(c)) for l in adapter.layers() for c in CANDIDATES if l.supports(policies.get(c))]

    # 1. the estimate for every layer and candidate (in memory: timed from scratch)
    t0 = time.perf_counter()
    with MeasurementCache(None) as cache:
        records = first_order.measure_terms(adapter, cache, lambda b, p, n: f"{b}|{p}|{n}", exp.loss_fn, batches,
                                            pairs_all, progress=False)
    estimate_s = time.perf_counter() - t0
    terms = {pair: first_order.combine(rs) for pair, rs in records.items()}
    load_after = _uptime()

    # 2. measured one-layer perplexity changes
    measured = _load_measured(args.measured)
    baseline = measured.get("float32")
    if baseline is None:
        baseline = measured["float32"] = exp.eval_fn(adapter.with_policies(policies.DTypePolicyMap("float32")))
    pairs = [pair for pair in sample_pairs(paths) if pair in terms]  # the layer has the candidate's kernel
    t1 = time.perf_counter()
    for path, name in pairs:
        k = f"{path}|{name}"
        if k not in measured:
            tuned = adapter.with_policies(adapter.complete_map({path: policies.get(name)}))
            measured[k] = exp.eval_fn(tuned)
            os.makedirs(os.path.dirname(args.measured) or ".", exist_ok=True)
            with open(args.measured, "w", encoding="utf-8") as f:
                json.dump(measured, f, indent=1)
    measure_s = time.perf_counter() - t1

    # 3. the table and the correlations
    rows = []
    for path, name in pairs:
        t = terms[(path, name)]
        rise = measured[f"{path}|{name}"] - baseline
        est = {e: first_order.metric_cost(first_order.loss_change(t, e), "exp", baseline) if e != "first"
               else baseline * math.expm1(t["first"]) for e in first_order.TERMS}
        rows.append((path.split("/", 1)[1], name, rise, est["first"], est["fisher"], est["both"], t["sqnr_db"]))
    lines = [
        f"# First-order sensitivity of SmolLM2-135M: estimated vs measured one-layer perplexity changes",
        "",
        f"Machine: {_cpu()}, {os.cpu_count()} cores; load average (1, 5, 15 min) {load_start} before, "
        f"{load_after} after the estimate, {_uptime()} at the end.",
        f"Command: `PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_first_order.py --windows {args.windows} "
        f"--start {args.start}`",
        "",
        f"- float32 perplexity (16 calibration-split windows of 128 tokens, the experiment's metric): {baseline:.4f}",
        f"- the estimate for all {len(adapter.layers())} tunable layers x {len(CANDIDATES)} candidates "
        f"({len(pairs_all)} pairs) from {len(batches)} batch(es) of 4 calibration windows (windows "
        f"{first}..{first + args.windows - 1}; the metric scores windows 0..15): {estimate_s:.1f} s "
        "(one compiled forward and backward pass per batch, then every layer under every candidate on its recorded "
        "inputs; compilation included)",
        f"- measured: {len(pairs)} pairs, each one perplexity evaluation of the model with that layer alone changed "
        f"({measure_s:.0f} s this run; earlier runs' measurements reused from {args.measured})",
        "",
        "Estimates are in perplexity units: ppl_fp32 * (exp(dL) - 1), dL the estimated change of the mean next-token "
        "loss; `first` = <g, e>, `fisher` = 0.5 N sum(g^2 e^2), `both` = their sum (negative estimates are shown "
        "for `first` only; the search clips costs at 0).",
        "",
        "| layer | candidate | measured rise | first | fisher | both | SQNR dB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for layer, name, rise, f1, f2, f3, sqnr in rows:
        lines.append(f"| {layer} | {name} | {rise:.4f} | {f1:.4f} | {f2:.4f} | {f3:.4f} | {sqnr:.1f} |")
    lines += ["", "Spearman rank correlation with the measured rise:", "",
              "| estimator | all pairs | " + " | ".join(CANDIDATES) + " |", "|---|---:|" + "---:|" * len(CANDIDATES)]
    cols = {"first": 3, "fisher": 4, "both": 5, "-SQNR": 6}
    for label, col in cols.items():
        sign = -1.0 if label == "-SQNR" else 1.0
        cells = [spearman([r[2] for r in rows], [sign * r[col] for r in rows])]
        for c in CANDIDATES:
            sub = [r for r in rows if r[1] == c]
            cells.append(spearman([r[2] for r in sub], [sign * r[col] for r in sub]))
        lines.append(f"| {label} | " + " | ".join(f"{v:.3f} (n={n})" for v, n in
                                                   zip(cells, [len(rows)] + [sum(r[1] == c for r in rows)
                                                                             for c in CANDIDATES])) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
