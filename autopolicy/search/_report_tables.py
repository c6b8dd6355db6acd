"""The tables and summary of a tuning run: pure functions of its typed phases (pandas is
imported only here, lazily)."""

from __future__ import annotations

import collections
import json
import math
from typing import Any, Sequence

import pandas as pd

from autopolicy.search import hardware, solver
from autopolicy.search._defaults import BUDGET_TOLERANCE, REFERENCE
from autopolicy.search.phases import AccuracyProfile, Budget, Configuration, LatencyProfile, Status
from autopolicy.search.profiling import format_tactics
from autopolicy.search.verify import make_problem

FRONTIER_COLUMNS = ("source", "name", "predicted_accuracy_cost", "predicted_metric", "predicted_latency_s",
                    "metric", "measured_latency_s", "nbytes", "changed_layers", "within_budget", "exact", "policies")


def profile_frame(latency: LatencyProfile, accuracy: AccuracyProfile, chosen: Configuration) -> pd.DataFrame:
    """One row per layer and candidate policy."""
    rows = []
    confirmed = dict(chosen.kernels)  # the kernels the end-to-end rounds chose over the profile's
    for site in latency.sites:
        for policy in site.candidates:
            t = latency.timing(site.path, policy.name)
            runs = chosen.assignment.get(site.path, REFERENCE) == policy.name
            acc = accuracy.get(site.path, policy.name)
            rows.append({
                "index": site.index,
                "layer": site.path,
                "class": site.layer.kind,
                "input_shape": "x".join(str(d) for d in site.input_shape),
                "chained": site.chained,
                "policy": policy.name,
                "compute_dtype": policy.compute_dtype,
                "kernel": confirmed.get(site.path, t.kernel) if runs else t.kernel,
                "tactics": format_tactics(t.tactics),
                "collectives": t.collectives,
                "latency_s": t.latency_s,
                "latency_p25_s": t.latency_p25_s,
                "latency_p75_s": t.latency_p75_s,
                "latency_cv": t.latency_cv,
                "repeats": t.repeats,
                "inner": t.inner,
                "nbytes": t.nbytes,
                "finite_output": t.finite,
                "metric": acc.metric if acc else math.nan,
                "accuracy_cost": acc.cost if acc else math.nan,
                "sqnr_db": acc.sqnr_db if acc else math.nan,
                "kl": acc.kl if acc else math.nan,
                "status": (acc.status + (" (proxy)" if acc.proxy else "")) if acc else "not measured",
                "proxy": acc.proxy if acc else "",
                "chosen": runs,
            })
    return pd.DataFrame(rows)


def _measured_frontier(configurations: Sequence[Configuration], budget: Budget) -> list[Configuration]:
    """The measured configurations no other beats on both metric (in its direction) and measured latency."""
    scored = [c for c in configurations if c.metric is not None and c.measured_latency_s is not None
              and math.isfinite(c.metric) and not c.disqualified]
    unique = {}
    for c in sorted(scored, key=lambda c: (c.measured_latency_s, -budget.goodness(c.metric))):
        unique.setdefault(json.dumps(c.changed, sort_keys=True), c)
    out, best = [], -math.inf
    for c in unique.values():  # fastest first: keep those that improve the metric
        if budget.goodness(c.metric) > best:
            out.append(c)
            best = budget.goodness(c.metric)
    return out


def frontier_frame(latency: LatencyProfile, accuracy: AccuracyProfile, budget: Budget,
                   configurations: Sequence[Configuration] = ()) -> pd.DataFrame:
    """The Pareto frontiers: ``source="measured"`` rows are the configurations timed and scored
    end to end that no other beats on both metric and latency (present in every run);
    ``source="predicted"`` rows are the solver's fastest assignment for every accuracy cost
    (present when the per-layer costs were measured)."""
    rows = []
    for c in _measured_frontier(configurations, budget):
        rows.append({
            "source": "measured", "name": c.name, "predicted_accuracy_cost": c.predicted_accuracy_cost,
            "predicted_metric": (budget.metric_after(c.predicted_accuracy_cost)
                                 if c.predicted_accuracy_cost is not None else math.nan),
            "predicted_latency_s": c.calibrated_latency_s if c.calibrated_latency_s is not None else c.predicted_latency_s,
            "metric": c.metric, "measured_latency_s": c.measured_latency_s, "nbytes": latency.nbytes(c.assignment),
            "changed_layers": len(c.changed), "within_budget": bool(c.meets_budget), "exact": c.exact,
            "policies": json.dumps(c.changed, sort_keys=True),
        })
    if accuracy.measured:
        problem = make_problem(latency, accuracy, budget.allowed_drop, budget.memory_budget)
        for solution in solver.frontier(problem.layers, budget.memory_budget):
            assignment = {k: v for k, v in solution.policies(problem.layers).items() if v != REFERENCE}
            rows.append({
                "source": "predicted", "name": "",
                "predicted_accuracy_cost": solution.accuracy_cost,
                "predicted_metric": budget.metric_after(solution.accuracy_cost),
                "predicted_latency_s": solution.latency,
                "metric": math.nan, "measured_latency_s": math.nan,
                "nbytes": solution.nbytes,
                "changed_layers": len(assignment),
                "within_budget": solution.accuracy_cost <= budget.allowed_drop + BUDGET_TOLERANCE,
                "exact": solution.exact,
                "policies": json.dumps(assignment, sort_keys=True),
            })
    return pd.DataFrame(rows, columns=FRONTIER_COLUMNS)


def _entry(e: Configuration, budget: Budget) -> dict[str, Any]:
    return {
        "predicted_latency_s": e.predicted_latency_s,
        "measured_latency_s": e.measured_latency_s,
        "measured_latency_cv": e.measured_latency_cv,
        "metric": e.metric,
        "drop": None if e.metric is None else budget.drop(e.metric),  # a rise when lower is better
        "meets_budget": e.meets_budget,
        "calibrated_latency_s": e.calibrated_latency_s,
        "speedup_vs_float32": e.speedup,
        "speedup_interval": None if e.speedup_low is None else [e.speedup_low, e.speedup_high],
        "rounds": e.rounds,
        "nbytes": e.nbytes,
        "excluded": e.excluded,
        # A workload's phases: median seconds per call of each (the total weighs them).
        **({"phases": dict(e.phase_latency_s)} if e.phase_latency_s else {}),
    }


def _budget(budget: Budget) -> dict[str, Any]:
    """The budget as the summary states it. ``allowed_drop`` is read in the metric's direction
    (the rise allowed above float32's metric when lower is better); the worst metric allowed is
    ``min_metric`` when higher is better, ``max_metric`` when lower is better, and
    ``limit_metric`` in both."""
    out = {"baseline_metric": budget.baseline_metric, "higher_is_better": budget.higher_is_better,
           "allowed_drop": budget.allowed_drop, "max_drop": budget.max_drop, "relative": budget.relative,
           "limit_metric": budget.limit_metric}
    out["min_metric" if budget.higher_is_better else "max_metric"] = budget.limit_metric
    out["memory_budget"] = budget.memory_budget
    return out


def summary(result: Any) -> dict[str, Any]:
    """The run's figures as JSON-able dicts (``summary.json``), from a ``TuneResult``."""
    budget, chosen = result.budget, result.chosen
    uniforms = {e.uniform: e for e in result.configurations if e.kind == "uniform"}
    maps = [e for e in result.configurations if e.kind == "map"]
    float32 = uniforms[REFERENCE]
    best_uniform = min((e for e in uniforms.values() if e.meets_budget and not e.excluded),
                       key=lambda e: e.measured_latency_s, default=chosen)
    out: dict[str, Any] = {
        "device": hardware.describe(result.hardware),
        "hardware": result.hardware,
        "fingerprint": result.fingerprint,
        "budget": _budget(budget),
        "memory": {
            "budget": budget.memory_budget,
            "chosen_nbytes": result.latency.nbytes(chosen.assignment),
            "float32_nbytes": result.latency.nbytes({}),
            "least_nbytes": result.latency.least_nbytes(),
        },
        "candidates": list(result.candidates),
        "layers": len(result.latency.sites),
        "chosen": {
            "name": chosen.name,
            "policies": chosen.changed,
            "predicted_accuracy_cost": chosen.predicted_accuracy_cost,
            "nbytes": result.latency.nbytes(chosen.assignment),
            # Layers whose kernel the end-to-end rounds chose over the one timed fastest alone.
            "kernels_end_to_end": dict(chosen.kernels),
            **_entry(chosen, budget),
        },
        "float32": _entry(float32, budget),
        "best_uniform": best_uniform.uniform,
        # The median of the paired per-round ratios, the statistic its interval is for; the ratio of
        # the two medians (which may pool rounds of other phases) only where no paired rounds exist.
        "speedup_vs_float32": (float32.measured_latency_s / chosen.measured_latency_s if chosen.speedup is None
                               else chosen.speedup),
        "speedup_vs_float32_interval": None if chosen.speedup_low is None else [chosen.speedup_low, chosen.speedup_high],
        "speedup_vs_best_uniform": best_uniform.measured_latency_s / chosen.measured_latency_s,
        "uniform": {name: _entry(e, budget) for name, e in uniforms.items()},
        "maps": [{"round": e.round, "predicted_accuracy_cost": e.predicted_accuracy_cost, "exact": e.exact,
                  "policies": dict(collections.Counter(e.assignment.values()).most_common()),
                  **_entry(e, budget)} for e in maps],
        "evaluations": dict(result.evaluations),
        "accuracy_profile": result.accuracy.method,
        "accuracy_scale": result.accuracy.scale,
        "accuracy_scales": None if result.accuracy.scales is None else dict(result.accuracy.scales),
        "cache": dict(result.cache_stats),
        "wall_time_s": result.wall_time_s,
        "decisions": list(result.decisions),
        "latency_model": {"scale": dict(result.calibration.scale) if result.calibration else {},
                          "fitted_on": result.calibration.configurations if result.calibration else 0,
                          "stream_bandwidth": result.latency.bandwidth},
        "noise": dict(result.noise or {}),
        "costs": dict(result.costs or {}),
    }
    if result.test is not None:
        out["test"] = dict(result.test)
    if getattr(result, "workload", None):
        out["workload"] = [dict(w) for w in result.workload]
    return out


__all__ = ["profile_frame", "frontier_frame", "summary", "FRONTIER_COLUMNS", "Status"]
