"""Phases 3 and 4: the solver's problem, and configurations verified end to end.

The solved map is scored and timed end to end, repaired while the budget breaks, and compared
with every uniform policy, all timed together; the fastest verified configuration wins.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from autopolicy import policies
from autopolicy.search import solver, timing
from autopolicy.search._context import Context
from autopolicy.search._defaults import REFERENCE
from autopolicy.search._progress import progress
from autopolicy.search.cache import key
from autopolicy.search.phases import AccuracyProfile, Configuration, LatencyProfile, Problem

__all__ = ["make_problem", "fastest_first", "solve_and_verify", "uniform", "measure_end_to_end", "choose", "Models"]

#: Models built for configurations, by configuration name (what ``eval_fn`` scored).
Models = dict


def make_problem(latency: LatencyProfile, accuracy: AccuracyProfile | None, budget: float,
                 memory_budget: float | None, inflate: Mapping | None = None) -> Problem:
    """The solver's layers: measured options with their (inflated) accuracy costs; with no
    accuracy profile, every option whose layer output stayed finite, at no accuracy cost."""
    inflate = inflate or {}
    layers = []
    for site in latency.sites:
        options = []
        for policy in site.candidates:
            t = latency.timing(site.path, policy.name)
            cost = 0.0
            if accuracy is None:
                if policy.name != REFERENCE and not t.finite:
                    continue
            else:
                acc = accuracy.get(site.path, policy.name)
                if acc is None or not acc.usable:
                    continue
                scale, add = inflate.get((site.path, policy.name), (1.0, 0.0))
                cost = acc.cost * scale + add
            options.append(solver.Option(policy.name, policy.compute_dtype, t.latency_s, cost, float(t.nbytes)))
        layers.append(solver.Layer(site.path, tuple(options), site.chained, latency.site_casts(site)))
    return Problem(tuple(layers), budget, memory_budget)


def _evaluate(ctx: Context, name: str, policy_map: policies.DTypePolicyMap, model: Any) -> float:
    cache_key = key(ctx.fingerprint, "verify", ctx.digest, policies.serialize(policy_map))
    value = ctx.cache.get_or_measure(cache_key, lambda: ctx.scorer.metric(model, name))
    ctx.cache.flush()
    return float(value)


def _verified(ctx: Context, models: Models, round_index: int, problem: Problem, solution: solver.Solution,
              costs_known: bool = True) -> Configuration:
    """The solution's map, built and scored end to end (cached)."""
    assignment = solution.policies(problem.layers)
    policy_map = ctx.adapter.complete_map(assignment)
    name = f"map (round {round_index})"
    models[name] = ctx.adapter.with_policies(policy_map)
    metric = _evaluate(ctx, f"round {round_index}", policy_map, models[name])
    return Configuration(name, "map", assignment, policy_map, solution.latency, round=round_index,
                         predicted_accuracy_cost=solution.accuracy_cost if costs_known else None,
                         exact=solution.exact, metric=metric, meets_budget=ctx.budget.meets(metric))


def fastest_first(ctx: Context, latency: LatencyProfile, models: Models) -> tuple[list[Configuration], bool]:
    """Verifies the fastest assignment (accuracy ignored) with one evaluation.

    Returns the verified configurations and whether the search is settled: the fastest
    assignment met the budget (no assignment is faster, so per-layer accuracy costs cannot
    change the choice), or it keeps every layer in float32 (nothing faster to try).
    """
    problem = make_problem(latency, None, math.inf, ctx.budget.memory_budget)
    solution = solver.solve(problem.layers, problem.budget, problem.memory_budget)
    if solution is None:
        return [], False
    if all(name == REFERENCE for name in solution.policies(problem.layers).values()):
        return [], True
    entry = _verified(ctx, models, 1, problem, solution, costs_known=False)
    return [entry], bool(entry.meets_budget)


def solve_and_verify(ctx: Context, latency: LatencyProfile, accuracy: AccuracyProfile, models: Models,
                     tried: list[Configuration]) -> list[Configuration]:
    """Solves, verifies the map end to end, and while the budget breaks, scales the costs of
    the layers it changed by what was observed and solves again (bounded rounds). Maps in
    ``tried`` are not verified again; the new configurations are returned."""
    inflate: dict = {}
    new: list[Configuration] = []
    for offset in progress(ctx.progress, range(ctx.max_rounds), "solve and verify"):
        round_index = len(tried) + offset + 1
        problem = make_problem(latency, accuracy, ctx.budget.allowed_drop, ctx.budget.memory_budget, inflate)
        solution = solver.solve(problem.layers, problem.budget, problem.memory_budget)
        if solution is None:
            break
        assignment = solution.policies(problem.layers)
        if any(t.assignment == assignment for t in tried + new):
            break
        entry = _verified(ctx, models, round_index, problem, solution)
        new.append(entry)
        if entry.meets_budget or not math.isfinite(entry.metric):
            break
        drop = ctx.budget.baseline_metric - entry.metric
        changed = list(entry.changed.items())
        excess = drop - solution.accuracy_cost
        ratio = drop / solution.accuracy_cost if solution.accuracy_cost > 0 else 1.0
        for path, name in changed:
            scale, add = inflate.get((path, name), (1.0, 0.0))
            inflate[(path, name)] = (scale * max(ratio, 1.0), add + max(excess, 0.0) / len(changed))
    return new


def uniform(ctx: Context, latency: LatencyProfile, policy: policies.DTypePolicy, tried: list[Configuration],
            models: Models) -> Configuration:
    """Every tunable layer on ``policy`` (float32 where it has no such kernel)."""
    assignment = {s.path: (policy.name if policy in s.candidates else REFERENCE) for s in latency.sites}
    # A layer whose output is not finite under the policy disqualifies the uniform policy.
    broken = tuple(p for p, n in assignment.items() if not latency.timing(p, n).finite)
    name = f"uniform {policy.name}"
    entry = Configuration(name, "uniform", assignment, ctx.adapter.complete_map(assignment),
                          latency.predicted_latency(assignment), uniform=policy.name, disqualified=broken)
    same = next((t for t in tried if t.assignment == assignment), None)
    if same is not None:  # the same model as a verified map: share its model and metric
        models[name] = models[same.name]
        return entry.with_(policy_map=same.policy_map, metric=same.metric)
    if policy.name == REFERENCE:
        models[name] = ctx.reference_model
        return entry.with_(metric=ctx.budget.baseline_metric)
    models[name] = ctx.adapter.with_policies(entry.policy_map)
    return entry


def measure_end_to_end(ctx: Context, entries: list[Configuration], models: Models) -> list[Configuration]:
    """Times every configuration's whole model, interleaved (cached by its map)."""
    todo, keys = {}, []
    shapes = [list(x.shape) for x in ctx.sample_args if hasattr(x, "shape")]
    for e in entries:
        cache_key = key(ctx.fingerprint, "e2e", ctx.digest, policies.serialize(e.policy_map), shapes,
                        ctx.repeats, timing.METHOD)
        keys.append(cache_key)
        if ctx.cache.lookup(cache_key) is None and cache_key not in todo:
            program = ctx.adapter.model_program(models[e.name])
            todo[cache_key] = timing.Candidate(program.fn, program.args, program.state)
    measured = timing.measure(todo, repeats=2 * ctx.repeats) if todo else {}
    for cache_key, t in measured.items():
        ctx.cache.get_or_measure(cache_key, lambda t=t: t.as_dict("latency_"))
    ctx.cache.flush()
    out = []
    for e, cache_key in zip(entries, keys):
        stats = ctx.cache.entries[cache_key]
        out.append(e.with_(measured_latency_s=stats["latency_median"], measured_latency_cv=stats["latency_cv"]))
    return out


def choose(ctx: Context, latency: LatencyProfile, tried: list[Configuration],
           models: Models) -> tuple[Configuration, list[Configuration], int]:
    """The fastest configuration that meets the budget, among the verified maps and the uniform
    policies (timed together); float32 unless it is ``min_speedup`` faster.

    Returns the winner, every configuration, and the evaluations spent only to report the best
    uniform policy.
    """
    reference = policies.DTypePolicy(REFERENCE)
    uniforms = [uniform(ctx, latency, p, tried, models)
                for p in [reference] + [c for c in ctx.candidates if c.name != REFERENCE]]
    timed = measure_end_to_end(ctx, tried + uniforms, models)
    tried, uniforms = timed[:len(tried)], timed[len(tried):]
    best_map = min((e for e in tried if e.meets_budget), key=lambda e: e.measured_latency_s, default=None)
    bar = best_map.measured_latency_s if best_map else math.inf
    float32 = uniforms[0].measured_latency_s
    report_only = 0
    # A uniform policy needs its metric if it could beat the map on latency (a decision), or
    # if it is faster than float32 (to report the best uniform policy honestly).
    for i in sorted(range(len(uniforms)), key=lambda i: uniforms[i].measured_latency_s):
        u = uniforms[i]
        if u.metric is None and not u.disqualified and u.measured_latency_s < max(bar, float32):
            before = ctx.scorer.evaluations
            metric = _evaluate(ctx, u.name, u.policy_map, models[u.name])
            if u.measured_latency_s >= bar:
                report_only += ctx.scorer.evaluations - before
            uniforms[i] = u.with_(metric=metric)
    uniforms = [u.with_(meets_budget=None if u.metric is None else ctx.budget.meets(u.metric) and not u.disqualified)
                for u in uniforms]
    entries = tried + uniforms
    # Ties (the same model reached as a map and as a uniform policy) go to the map.
    winner = min((e for e in entries if e.meets_budget), key=lambda e: (e.measured_latency_s, e.kind != "map"))
    # A change must pay for itself: within noise of float32, float32 stays.
    if winner.measured_latency_s * ctx.min_speedup > uniforms[0].measured_latency_s:
        winner = uniforms[0]
    return winner, entries, report_only
