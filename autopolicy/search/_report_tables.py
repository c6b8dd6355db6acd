"""The tables and summary a tuning run returns (pandas is imported only here, lazily)."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pandas as pd

from autopolicy.search import hardware, solver

FLOAT32 = "float32"
FRONTIER_COLUMNS = ("predicted_accuracy_cost", "predicted_metric", "predicted_latency_s", "nbytes",
                    "changed_layers", "within_budget", "exact", "policies")


def profile_frame(run: Any, winner: dict) -> pd.DataFrame:
    """One row per layer and candidate policy."""
    rows = []
    for site in run.sites:
        for policy in site.candidates:
            lat = run.latency[site.path][policy.name]
            acc = run.accuracy.get(site.path, {}).get(policy.name, {})
            rows.append({
                "index": site.index,
                "layer": site.path,
                "class": type(site.layer).__name__,
                "input_shape": "x".join(str(d) for d in site.input_shape),
                "chained": site.chained,
                "policy": policy.name,
                "compute_dtype": policy.compute_dtype,
                "latency_s": lat["latency_s"],
                "latency_p25_s": lat["latency_p25"],
                "latency_p75_s": lat["latency_p75"],
                "latency_cv": lat["latency_cv"],
                "repeats": lat["latency_repeats"],
                "inner": lat["latency_inner"],
                "nbytes": lat["nbytes"],
                "finite_output": lat["finite"],
                "metric": acc.get("metric", math.nan),
                "accuracy_cost": acc.get("cost", math.nan),
                "sqnr_db": acc.get("sqnr_db", math.nan),
                "kl": acc.get("kl", math.nan),
                "status": acc.get("status", "reference" if policy.name == FLOAT32 else "not measured"),
                "chosen": winner["assignment"].get(site.path, FLOAT32) == policy.name,
            })
    return pd.DataFrame(rows)


def frontier_frame(run: Any) -> pd.DataFrame:
    """The predicted Pareto frontier: the fastest assignment for every accuracy cost (empty when
    the accuracy costs were not measured)."""
    layers = run.problem()
    rows = []
    for solution in ([] if _skipped(run) else solver.frontier(layers, run.memory_budget)):
        assignment = {k: v for k, v in solution.policies(layers).items() if v != FLOAT32}
        rows.append({
            "predicted_accuracy_cost": solution.accuracy_cost,
            "predicted_metric": run.baseline - solution.accuracy_cost,
            "predicted_latency_s": solution.latency,
            "nbytes": solution.nbytes,
            "changed_layers": len(assignment),
            "within_budget": solution.accuracy_cost <= run.budget + 1e-12,
            "exact": solution.exact,
            "policies": json.dumps(assignment, sort_keys=True),
        })
    return pd.DataFrame(rows, columns=FRONTIER_COLUMNS)


def _entry(e: dict, baseline: float) -> dict[str, Any]:
    metric = e.get("metric")
    return {
        "predicted_latency_s": e.get("predicted_latency_s"),
        "measured_latency_s": e.get("measured_latency_s"),
        "measured_latency_cv": e.get("measured_latency_cv"),
        "metric": metric,
        "drop": None if metric is None else baseline - metric,
        "meets_budget": e.get("meets_budget"),
    }


def _skipped(run: Any) -> bool:
    return any(str(entry.get("status", "")).startswith("not needed")
               for table in run.accuracy.values() for entry in table.values())


def summary(run: Any, winner: dict, entries: list[dict], profile_evaluations: int, test_fn) -> dict[str, Any]:
    uniforms = {e["name"].removeprefix("uniform "): e for e in entries if e["name"].startswith("uniform ")}
    maps = [e for e in entries if "round" in e]
    float32 = uniforms[FLOAT32]
    meeting = [e for e in uniforms.values() if e.get("meets_budget")]
    best_uniform = min(meeting, key=lambda e: e["measured_latency_s"])
    chosen_bytes = sum(
        run.latency[s.path][winner["assignment"].get(s.path, FLOAT32)]["nbytes"] for s in run.sites
    )
    out: dict[str, Any] = {
        "device": hardware.describe(run.hardware),
        "hardware": run.hardware,
        "fingerprint": run.fingerprint,
        "budget": {
            "baseline_metric": run.baseline,
            "allowed_drop": run.budget,
            "min_metric": run.baseline - run.budget,
            "memory_budget": run.memory_budget,
        },
        "candidates": [c.name for c in run.candidates],
        "layers": len(run.sites),
        "chosen": {
            "name": winner["name"],
            "policies": {k: v for k, v in winner["assignment"].items() if v != FLOAT32},
            "predicted_accuracy_cost": winner.get("predicted_cost"),
            "nbytes": chosen_bytes,
            **_entry(winner, run.baseline),
        },
        "float32": _entry(float32, run.baseline),
        "best_uniform": best_uniform["name"].removeprefix("uniform "),
        "speedup_vs_float32": float32["measured_latency_s"] / winner["measured_latency_s"],
        "speedup_vs_best_uniform": best_uniform["measured_latency_s"] / winner["measured_latency_s"],
        "uniform": {name: _entry(e, run.baseline) for name, e in uniforms.items()},
        "maps": [{"round": e["round"], "predicted_accuracy_cost": e["predicted_cost"], "exact": e["exact"],
                  **_entry(e, run.baseline)} for e in maps],
        "evaluations": {
            "profile": profile_evaluations,
            "verify": run.scorer.evaluations - profile_evaluations - run.report_evaluations,
            "report_only": run.report_evaluations,
            "total": run.scorer.evaluations,
        },
        "accuracy_profile": "skipped" if _skipped(run) else "measured",
        "cache": {"hits": run.cache.hits, "misses": run.cache.misses},
        "wall_time_s": time.perf_counter() - run.start,
    }
    if test_fn is not None:
        out["test"] = {"float32": float(test_fn(run.base)), "chosen": float(test_fn(winner["model"]))}
    return out
