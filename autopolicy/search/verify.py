"""Verification: the solved map scored and timed end to end, repaired while the budget breaks,
and compared with every uniform policy, timed together; the fastest verified choice wins."""

from __future__ import annotations

import math
from typing import Any

from autopolicy import policies
from autopolicy.search import solver, timing
from autopolicy.search._progress import progress
from autopolicy.search.cache import key

__all__ = ["fastest_first", "solve_and_verify", "choose"]

FLOAT32 = "float32"


def evaluate_map(run: Any, name: str, policy_map: policies.DTypePolicyMap, model: Any) -> float:
    cache_key = key(run.fingerprint, "verify", run.digest, policies.serialize(policy_map))
    value = run.cache.get_or_measure(cache_key, lambda: run.scorer.metric(model, name))
    run.cache.flush()
    return float(value)


def _verified(run: Any, round_index: int, layers: list, solution: Any) -> dict:
    """The solution's map, built and scored end to end (cached)."""
    assignment = solution.policies(layers)
    policy_map = run.policy_map(assignment)
    model = run.variant(policy_map)
    metric = evaluate_map(run, f"round {round_index}", policy_map, model)
    return {"name": f"map (round {round_index})", "assignment": assignment, "policy_map": policy_map,
            "model": model, "metric": metric, "predicted_cost": solution.accuracy_cost, "exact": solution.exact,
            "predicted_latency_s": solution.latency, "round": round_index}


def _meets(run: Any, entry: dict) -> bool:
    return math.isfinite(entry["metric"]) and run.baseline - entry["metric"] <= run.budget + 1e-12


def fastest_first(run: Any) -> tuple[list[dict], bool]:
    """Verifies the fastest assignment (accuracy ignored) with one evaluation.

    Returns the verified entries and whether the search is settled: the fastest assignment met
    the budget (no assignment can be faster, so per-layer accuracy costs cannot change the
    choice), or it keeps every layer in float32 (nothing is faster to try).
    """
    layers = run.problem(latency_only=True)
    solution = solver.solve(layers, math.inf, run.memory_budget)
    if solution is None:
        return [], False
    if all(name == FLOAT32 for name in solution.policies(layers).values()):
        return [], True
    entry = _verified(run, 1, layers, solution)
    entry["predicted_cost"] = None  # the costs were not measured, only ignored
    return [entry], _meets(run, entry)


def solve_and_verify(run: Any, tried: list[dict] | None = None) -> list[dict]:
    """Solves, verifies the map end to end, and while the budget breaks, scales the costs of
    the layers it changed by what was observed and solves again (bounded rounds).

    ``tried``: maps verified before (not repeated); the new ones are returned."""
    inflate: dict = {}
    previous = list(tried or [])
    tried = []
    for offset in progress(run.progress, range(run.max_rounds), "solve and verify"):
        round_index = len(previous) + offset + 1
        layers = run.problem(inflate)
        solution = solver.solve(layers, run.budget, run.memory_budget)
        if solution is None:
            break
        assignment = solution.policies(layers)
        if any(t["assignment"] == assignment for t in previous + tried):
            break
        entry = _verified(run, round_index, layers, solution)
        tried.append(entry)
        drop = run.baseline - entry["metric"]
        if _meets(run, entry) or not math.isfinite(entry["metric"]):
            break
        changed = [(p, n) for p, n in assignment.items() if n != FLOAT32]
        excess = drop - solution.accuracy_cost
        for path, name in changed:
            scale, add = inflate.get((path, name), (1.0, 0.0))
            ratio = drop / solution.accuracy_cost if solution.accuracy_cost > 0 else 1.0
            inflate[(path, name)] = (scale * max(ratio, 1.0), add + max(excess, 0.0) / len(changed))
    return tried


def uniform(run: Any, policy: policies.DTypePolicy, tried: list[dict]) -> dict:
    """Every tunable layer on ``policy`` (float32 where it has no such kernel)."""
    assignment = {s.path: (policy.name if policy in s.candidates else FLOAT32) for s in run.sites}
    # A layer whose output is not finite under the policy disqualifies the uniform policy.
    broken = [p for p, n in assignment.items() if not run.latency[p][n]["finite"]]
    entry = {"name": f"uniform {policy.name}", "assignment": assignment, "disqualified": broken,
             "predicted_latency_s": run.predicted_latency(assignment)}
    same = next((t for t in tried if t["assignment"] == assignment), None)
    if same is not None:  # the same model as a verified map: share its model and metric
        return {**entry, "policy_map": same["policy_map"], "model": same["model"], "metric": same["metric"]}
    policy_map = run.policy_map(assignment)
    is_float32 = policy.name == FLOAT32
    return {**entry, "policy_map": policy_map, "model": run.base if is_float32 else run.variant(policy_map),
            "metric": run.baseline if is_float32 else None}


def measure_end_to_end(run: Any, entries: list[dict]) -> None:
    """Times every entry's whole model, interleaved, and records ``measured_latency_s``."""
    todo = {}
    for e in entries:
        cache_key = key(run.fingerprint, "e2e", run.digest, policies.serialize(e["policy_map"]),
                        [list(x.shape) for x in run.args if hasattr(x, "shape")], run.repeats,
                        timing.METHOD)
        e["cache_key"] = cache_key
        if cache_key not in run.cache and cache_key not in todo:
            todo[cache_key] = timing.Candidate(lambda m, *a: m(*a), run.args, e["model"])
    measured = timing.measure(todo, repeats=2 * run.repeats) if todo else {}
    for cache_key, t in measured.items():
        run.cache.get_or_measure(cache_key, lambda t=t: t.as_dict("latency_"))
    for e in entries:
        stats = run.cache.entries[e["cache_key"]]
        e["measured_latency_s"] = stats["latency_median"]
        e["measured_latency_cv"] = stats["latency_cv"]
    run.cache.flush()


def choose(run: Any, tried: list[dict]) -> tuple[dict, list[dict]]:
    uniforms = [uniform(run, p, tried) for p in [policies.DTypePolicy(FLOAT32)] + [
        c for c in run.candidates if c.name != FLOAT32]]
    entries = tried + uniforms
    measure_end_to_end(run, entries)
    verified = [e for e in tried if run.baseline - e["metric"] <= run.budget + 1e-12]
    best_map = min(verified, key=lambda e: e["measured_latency_s"], default=None)
    bar = best_map["measured_latency_s"] if best_map else math.inf
    float32 = uniforms[0]["measured_latency_s"]
    # A uniform policy needs its metric if it could beat the map on latency (a decision), or
    # if it is faster than float32 (to report the best uniform policy honestly).
    for u in sorted(uniforms, key=lambda e: e["measured_latency_s"]):
        if u["metric"] is None and not u["disqualified"] and u["measured_latency_s"] < max(bar, float32):
            before = run.scorer.evaluations
            u["metric"] = evaluate_map(run, u["name"], u["policy_map"], u["model"])
            if u["measured_latency_s"] >= bar:
                run.report_evaluations += run.scorer.evaluations - before
    for e in entries:
        e["meets_budget"] = None if e["metric"] is None else bool(
            math.isfinite(e["metric"]) and run.baseline - e["metric"] <= run.budget + 1e-12
            and not e.get("disqualified"))
    # Ties (the same model reached as a map and as a uniform policy) go to the map.
    winner = min((e for e in entries if e["meets_budget"]),
                 key=lambda e: (e["measured_latency_s"], "round" not in e))
    # A change must pay for itself: within noise of float32, float32 stays.
    if winner["measured_latency_s"] * run.min_speedup > uniforms[0]["measured_latency_s"]:
        winner = uniforms[0]
    return winner, entries
