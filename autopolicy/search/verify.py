"""Phases 3 and 4: the solver's problem, and configurations verified end to end.

The solved map is scored and timed end to end, repaired while the budget breaks, and compared
with every uniform policy, all timed together; the fastest verified configuration wins.
"""

from __future__ import annotations

import math
import time
from typing import Any, Collection, Mapping, Sequence

from autopolicy import _multihost, policies
from autopolicy.search import solver
from autopolicy.search._context import Context
from autopolicy.search._defaults import REFERENCE
from autopolicy.search._progress import progress
from autopolicy.search.cache import key
from autopolicy.search.confidence import Speedup
from autopolicy.search.costs import phase
from autopolicy.search.endtoend import EndToEnd, config_key
from autopolicy.search.latency_model import IDENTITY, Calibration
from autopolicy.search.phases import AccuracyProfile, Configuration, LatencyProfile, Problem, Status, failed

__all__ = ["make_problem", "fastest_first", "solve_and_verify", "uniform", "uniforms", "score_uniforms", "decide",
           "unsettled", "choose", "Models", "over_memory", "kernel_sets", "confirm_kernels", "KERNEL_SETS_WITHIN"]

#: Models built for configurations, by configuration name (what ``eval_fn`` scored).
Models = dict


def make_problem(latency: LatencyProfile, accuracy: AccuracyProfile | None, budget: float,
                 memory_budget: float | None, added: Mapping | None = None,
                 calibration: Calibration = IDENTITY, no_reference: Collection[str] = ()) -> Problem:
    """The solver's layers: measured options with their accuracy costs (plus ``added``, per
    ``(path, policy name)``, what verification showed they had missed); with no
    accuracy profile, every option whose layer output stayed finite, at no accuracy cost.
    Layer latencies are scaled by the calibrated latency model. The layers in ``no_reference``
    lose their float32 option."""
    added = added or {}
    layers = []
    for site in latency.sites:
        options = []
        for policy in site.candidates:
            if policy.name == REFERENCE and site.path in no_reference:
                continue
            t = latency.timing(site.path, policy.name)
            cost = 0.0
            if accuracy is None:
                if policy.name != REFERENCE and not t.finite:
                    continue
            else:
                acc = accuracy.get(site.path, policy.name)
                if acc is None or not acc.usable:
                    continue
                cost = acc.cost + added.get((site.path, policy.name), 0.0)
            seconds = latency.latency_s(site, policy.name) * calibration.factor(policy.name)
            options.append(solver.Option(policy.name, policy.compute_dtype, seconds, cost, float(t.nbytes)))
        layers.append(solver.Layer(site.path, tuple(options), site.chained, latency.site_casts(site)))
    return Problem(tuple(layers), budget, memory_budget)


def _evaluate(ctx: Context, name: str, policy_map: policies.DTypePolicyMap, model: Any) -> float:
    cache_key = key(ctx.fingerprint, "verify", ctx.digest, policies.serialize(policy_map))
    with phase("verify"):
        value = ctx.cache.get_or_measure(cache_key, lambda: ctx.scorer.metric(model, name))
    ctx.cache.flush()
    return float(value)


def _verified(ctx: Context, models: Models, round_index: int, problem: Problem, solution: solver.Solution,
              costs_known: bool = True) -> Configuration:
    """The solution's map, built and scored end to end (cached)."""
    assignment = solution.policies(problem.layers)
    policy_map = ctx.adapter.complete_map(assignment)
    name = f"map (round {round_index})"
    entry = Configuration(name, "map", assignment, policy_map, solution.latency, round=round_index,
                          predicted_accuracy_cost=solution.accuracy_cost if costs_known else None,
                          exact=solution.exact, nbytes=solution.nbytes)
    # The solver keeps to the memory budget; a map over it is refused all the same, unbuilt.
    failure = over_memory(ctx, int(solution.nbytes)) or _build(ctx, models, entry)
    if not failure:
        try:
            metric = _evaluate(ctx, f"round {round_index}", policy_map, models[name])
        except Exception as e:  # pylint: disable=broad-except
            failure = failed("evaluate", e)
    if failure:
        return entry.with_(excluded=failure, metric=math.nan, meets_budget=False)
    return entry.with_(metric=metric, meets_budget=ctx.budget.meets(metric))


def _build(ctx: Context, models: Models, entry: Configuration) -> str:
    """Builds ``entry``'s model into ``models``; returns why it failed ("" when it did not)."""
    try:
        models[entry.name] = ctx.adapter.with_policies(entry.policy_map)
    except Exception as e:  # pylint: disable=broad-except
        return failed("build", e)
    return ""


def over_memory(ctx: Context, nbytes: int) -> str:
    """Why ``nbytes`` of tuned weights break the memory budget ("" when they do not)."""
    budget = ctx.budget.memory_budget
    if budget is None or nbytes <= budget:
        return ""
    return f"over the memory budget: {nbytes:,} bytes > {int(budget):,}"


def fastest_first(ctx: Context, latency: LatencyProfile, models: Models,
                  calibration: Calibration = IDENTITY) -> tuple[list[Configuration], bool]:
    """Verifies the fastest assignment (accuracy ignored) with one evaluation.

    Returns the verified configurations and whether the search is settled: the fastest
    assignment met the budget (no assignment is faster, so per-layer accuracy costs cannot
    change the choice), or it keeps every layer in float32 (nothing faster to try).
    """
    problem = make_problem(latency, None, math.inf, ctx.budget.memory_budget, calibration=calibration)
    with phase("solve"):
        solution = solver.solve(problem.layers, problem.budget, problem.memory_budget)
    if solution is None:
        return [], False
    if all(name == REFERENCE for name in solution.policies(problem.layers).values()):
        return [], True
    entry = _verified(ctx, models, 1, problem, solution, costs_known=False)
    return [entry], bool(entry.meets_budget)


def solve_and_verify(ctx: Context, latency: LatencyProfile, accuracy: AccuracyProfile, models: Models,
                     tried: list[Configuration], calibration: Calibration = IDENTITY,
                     uniform_configs: Sequence[Configuration] = ()) -> list[Configuration]:
    """Solves, verifies the map end to end, and while the budget breaks, solves again (bounded
    rounds) with what the miss showed: the summed costs run ``observed / predicted`` times too
    low, so the solver's budget shrinks by that ratio (the estimate's error is a property of
    every layer it adds up, not only of those the missed map changed), and the miss's excess is
    spread over the layers it changed (that map, over the budget as observed, is not proposed
    again). Maps in ``tried`` are not verified again; the new configurations are returned.

    Then, when a uniform policy of ``uniform_configs`` was scored within the budget, maps solved
    from that policy up (see :func:`_anchor`), repaired the same way in up to as many rounds."""
    added: dict = {}
    shrink = 1.0
    new: list[Configuration] = []

    def attempt(round_index: int, no_reference: Collection[str] = ()) -> tuple[Configuration, Any] | None:
        problem = make_problem(latency, accuracy, ctx.budget.allowed_drop * shrink, ctx.budget.memory_budget, added,
                               calibration, no_reference)
        with phase("solve"):
            solution = solver.solve(problem.layers, problem.budget, problem.memory_budget)
        if solution is None:
            return None
        assignment = solution.policies(problem.layers)
        # (an anchored map equal to a uniform policy is that policy, already scored)
        if any(t.assignment == assignment for t in [*tried, *new, *(uniform_configs if no_reference else ())]):
            return None
        entry = _verified(ctx, models, round_index, problem, solution)
        new.append(entry)
        return entry, solution

    def repair_rounds(what: str, no_reference: Collection[str] = ()) -> None:
        nonlocal shrink
        for _ in progress(ctx.progress, range(ctx.max_rounds), what):
            verified = attempt(len(tried) + len(new) + 1, no_reference)
            if verified is None:
                break
            entry, solution = verified
            if entry.meets_budget or not math.isfinite(entry.metric):
                break
            drop = ctx.budget.drop(entry.metric)  # in the metric's direction: a rise when lower is better
            changed = list(entry.changed.items())
            excess = drop - solution.accuracy_cost
            if drop > 0 and solution.accuracy_cost > 0:
                shrink *= min(1.0, solution.accuracy_cost / drop)
            for pair in changed:
                added[pair] = added.get(pair, 0.0) + max(excess, 0.0) / len(changed)

    repair_rounds("solve and verify")
    anchored: set[str] = set()
    anchor = _anchor(ctx, latency, calibration, uniform_configs)
    if anchor is not None:
        # Repaired as the plain solve is, what its misses taught kept: on SmolLM2 (2-core Xeon) the
        # anchored map missed +2% by 0.2 points where the plain one kept 60 projections in float32.
        anchored = {p for p, name in anchor.assignment.items() if name == anchor.uniform}
        repair_rounds("anchored solve", anchored)
    problem = make_problem(latency, accuracy, ctx.budget.allowed_drop * shrink, ctx.budget.memory_budget, added,
                           calibration, anchored)
    solution = headroom(ctx, problem)
    if solution is not None and not any(t.assignment == solution.policies(problem.layers) for t in [*tried, *new]):
        new.append(_verified(ctx, models, len(tried) + len(new) + 1, problem, solution))
    return new


def headroom(ctx: Context, problem: Problem) -> solver.Solution | None:
    """Of the solutions predicted no slower than the fastest within the budget by more than the
    decision margin (``min_speedup``), the one that spends the least of the accuracy budget; None
    when that is the fastest itself. Solved on the repair rounds' last problem (budget shrunk,
    misses' costs added, float32 taken away where the anchor reaches).

    The solver spends the whole budget for any predicted gain, however small; the metric it is
    held to is measured on a sample, so a map at the edge of the budget is the likeliest to break
    it on other text (the winner's curse). A speed-up inside the margin cannot be told from
    noise; this map costs one evaluation and lets :func:`decide` keep the accuracy unless the
    fastest map is measurably faster. On SmolLM2 (2-core Xeon) the map at +1.35% on the tune's
    windows was +2.40% on held-out text."""
    with phase("solve"):
        points = [p for p in solver.frontier(problem.layers, problem.memory_budget)
                  if p.accuracy_cost <= problem.budget]
    if not points:
        return None
    fastest = min(points, key=lambda p: (p.latency, p.accuracy_cost))
    safest = min((p for p in points if p.latency <= fastest.latency * ctx.min_speedup),
                 key=lambda p: (p.accuracy_cost, p.latency))
    return None if safest.choice == fastest.choice else safest


def _anchor(ctx: Context, latency: LatencyProfile, calibration: Calibration,
            uniform_configs: Sequence[Configuration]) -> Configuration | None:
    """The uniform policy, scored within the budget, that the latency model predicts fastest.

    A map solved with float32 taken away from the layers it covers starts from a verified point:
    moving every one of them off float32 onto it was affordable. The plain solve can prefer
    float32 for small layers whose isolated timings flatter it; on SmolLM2 (2-core Xeon) its map
    within +2% kept 118 projections in float32 and decoded at 21.6 ms, where the same map with
    those on gptq/8 decoded at 16.2 ms (uniform gptq/8: 17.0 ms) at a lower perplexity."""
    feasible = [u for u in uniform_configs if u.uniform != REFERENCE and u.metric is not None
                and math.isfinite(u.metric) and ctx.budget.meets(u.metric) and not u.disqualified and not u.excluded]
    if not feasible:
        return None
    return min(feasible, key=lambda u: calibration.predict(latency, u.assignment))


def uniform(ctx: Context, latency: LatencyProfile, policy: policies.DTypePolicy, models: Models) -> Configuration:
    """Every tunable layer on ``policy`` (float32 where it has no such kernel)."""
    assignment = {s.path: (policy.name if policy in s.candidates else REFERENCE) for s in latency.sites}
    # A layer whose output is not finite under the policy disqualifies the uniform policy.
    broken = tuple(p for p, n in assignment.items() if not latency.timing(p, n).finite)
    name = f"uniform {policy.name}"
    nbytes = latency.nbytes(assignment)
    entry = Configuration(name, "uniform", assignment, ctx.adapter.complete_map(assignment),
                          latency.predicted_latency(assignment), uniform=policy.name, disqualified=broken,
                          nbytes=nbytes, excluded=over_memory(ctx, nbytes))
    if policy.name == REFERENCE:
        models[name] = ctx.reference_model
        return entry.with_(metric=ctx.budget.baseline_metric, meets_budget=True)
    failure = _build(ctx, models, entry)
    return entry.with_(excluded=failure) if failure else entry


def uniforms(ctx: Context, latency: LatencyProfile, models: Models) -> list[Configuration]:
    """float32 first, then every other candidate as a uniform policy."""
    reference = policies.DTypePolicy(REFERENCE)
    return [uniform(ctx, latency, p, models) for p in [reference] + [c for c in ctx.candidates if c != reference]]


def score_uniforms(ctx: Context, accuracy: AccuracyProfile, uniform_configs: list[Configuration],
                   models: Models) -> list[Configuration]:
    """``uniform_configs`` with the metric of each uniform policy that has per-layer estimates in
    ``accuracy`` (built, not disqualified), scored end to end now: what the estimates of its
    layers should add up to (first_order.calibrate), over the memory budget or not. The final
    choice reuses these scores."""
    scored = []
    for u in uniform_configs:
        estimated = any(acc.status == Status.FIRST_ORDER for row in accuracy.entries.values()
                        for name, acc in row.items() if name == u.uniform)
        if u.metric is None and estimated and not u.disqualified and u.name in models:  # built
            try:
                u = u.with_(metric=_evaluate(ctx, u.name, u.policy_map, models[u.name]))
            except Exception as e:  # pylint: disable=broad-except
                u = u.with_(metric=math.nan, excluded=failed("evaluate", e))
        scored.append(u)
    return scored


def _timed(e2e: EndToEnd, config: Configuration, float32: Configuration) -> Configuration:
    failure = e2e.failure(config)
    if failure or not e2e.samples(config):
        return config.with_(excluded=config.excluded or failure or "not timed")
    t, s = e2e.summary(config), e2e.speedup(config, float32)
    phases = e2e.phase_medians(config) if hasattr(e2e, "phase_medians") else ()
    return config.with_(measured_latency_s=t.median, measured_latency_cv=t.cv, speedup=s.median,
                        speedup_low=s.low, speedup_high=s.high, rounds=s.rounds, phase_latency_s=phases)


def _challenge(ctx: Context, e2e: EndToEnd, challenger: Configuration, incumbent: Configuration) -> Speedup:
    """The challenger's speed-up over the incumbent; while its interval straddles the margin,
    more paired rounds of the two, up to the run's confirmation time.

    Each batch of extra rounds is half as many as the rounds so far (at least the run's
    repeats), and the time spent on the intervals counts against the confirmation time too: a
    bootstrap over n rounds costs O(n), and for a model timed in microseconds a fixed batch
    size let the intervals, not the rounds, take the time (a test tune ran for over ten
    minutes in this loop)."""
    speedup = e2e.speedup(challenger, incumbent)
    analysis = 0.0
    while (speedup.straddles(ctx.min_speedup) and e2e.extra_seconds + analysis < ctx.confirm_seconds
           and e2e.more([challenger, incumbent], max(ctx.repeats, speedup.rounds // 2))):
        start = time.perf_counter()
        speedup = e2e.speedup(challenger, incumbent)
        # The slowest process's time, as for the rounds: every process stops at the same moment.
        analysis += float(_multihost.slowest([time.perf_counter() - start])[0])
    return speedup


def _closest(ctx: Context, considered: list[Configuration]) -> str:
    """The configurations evaluated, nearest the accuracy limit first (at most three), each with
    its metric and weight bytes against the two budgets: how far off the budgets are."""
    scored = [c for c in considered if c.metric is not None and math.isfinite(c.metric)]
    if not scored:
        return ""
    limit = ctx.budget.limit_metric
    scored.sort(key=lambda c: abs(c.metric - limit))
    parts = []
    for c in scored[:3]:
        why = c.excluded or ("within the accuracy budget" if c.meets_budget else "over the accuracy budget")
        size = "" if c.nbytes is None else f", {int(c.nbytes):,} bytes"
        parts.append(f"{c.name}: metric {c.metric:.6g}{size} ({why})")
    memory = "" if ctx.budget.memory_budget is None else f", memory budget {int(ctx.budget.memory_budget):,} bytes"
    return (f" Closest evaluated (metric limit {limit:.6g}{memory}): " + "; ".join(parts) +
            ". Allow a larger max_drop or memory budget.")


def decide(ctx: Context, e2e: EndToEnd, float32: Configuration,
           contenders: list[Configuration],
           considered: list[Configuration] | None = None) -> tuple[Configuration, list[str]]:
    """Float32 unless a configuration is faster by the margin with confidence.

    Uniform policies challenge first (fastest first), then maps challenge the incumbent, the
    most accurate map first: a map replaces a uniform policy, or a more accurate map, only if it
    is itself faster by the margin (accuracy is given up only for speed that is measured). When
    an interval straddles the margin after the extra rounds, the simpler (or more accurate)
    incumbent stays.
    """
    incumbent, log = float32, []
    if float32.excluded:
        if not contenders:
            raise ValueError(f"No configuration can be chosen: float32 is {float32.excluded}, and no other "
                             "configuration within the accuracy budget fits." + _closest(ctx, considered or []))
        incumbent = min(contenders, key=lambda c: c.measured_latency_s)
        log.append(f"{float32.name} cannot be chosen ({float32.excluded}): {incumbent.name}, the fastest "
                   "configuration that can, is the incumbent")
    uniforms = sorted((c for c in contenders if c.kind == "uniform"), key=lambda c: c.measured_latency_s)
    maps = sorted((c for c in contenders if c.kind == "map"), key=lambda c: (_spent(ctx, c), c.measured_latency_s))
    for kind, challengers in (("uniform", uniforms), ("map", maps)):
        for c in challengers:
            if config_key(c) == config_key(incumbent):
                continue
            speedup = _challenge(ctx, e2e, c, incumbent)
            verdict = "replaces" if speedup.clears(ctx.min_speedup) else "does not replace"
            log.append(f"{c.name} {verdict} {incumbent.name}: {speedup} (margin {ctx.min_speedup:g})")
            if speedup.clears(ctx.min_speedup):
                incumbent = c
                if kind == "uniform":  # the fastest uniform policy that clears; maps go on challenging
                    break
    return incumbent, log


def _spent(ctx: Context, config: Configuration) -> float:
    """How much of the accuracy budget a configuration's measured metric spent (0 unscored)."""
    if config.metric is None or not math.isfinite(config.metric):
        return 0.0
    return ctx.budget.drop(config.metric)


#: The fewest paired rounds an interval is computed from (confidence.paired_speedup's minimum).
MIN_PAIRED_ROUNDS = 3


def unsettled(ctx: Context, e2e: EndToEnd, float32: Configuration, others: list[Configuration]) -> list[Configuration]:
    """What the final rounds must still time: float32 and every configuration whose speed-up
    over it is not yet clearly above or clearly below the margin (its interval straddles it, or
    they have not yet shared the rounds an interval needs); empty once none is left. A
    configuration already decided is timed no more: the rounds go to the close calls
    (:func:`decide` reads the speed-ups over float32 first, and gives close calls between other
    configurations extra rounds of their own).

    A configuration that earlier rounds (the calibration's, of the uniform policies) already
    show clearly slower than float32 by the margin is left out from the start: it can neither
    replace float32 nor become the incumbent a map challenges, so it needs no rounds with the
    maps (unless float32 cannot be chosen, when the fastest other configuration is the
    incumbent). A later run whose map differs times that map with float32 and the uniform
    policies that could win, not every uniform policy again."""
    if e2e.failure(float32):
        return []
    timed = [c for c in others if not e2e.failure(c)]
    if not float32.excluded:
        timed = [c for c in timed if not _clearly_slower(ctx, e2e, c, float32)]
    if e2e.rounds_together([float32] + timed) < MIN_PAIRED_ROUNDS:
        # Every pair gets an interval first: decide may compare any two of these (a map with the
        # uniform policy it challenges), and two decided at once would share no more rounds.
        return [float32] + timed
    open_ = [c for c in timed if e2e.speedup(c, float32).straddles(ctx.min_speedup)]
    return [float32] + open_ if open_ else []


def _clearly_slower(ctx: Context, e2e: EndToEnd, config: Configuration, float32: Configuration) -> bool:
    """Whether rounds so far put ``config``'s speed-up over float32 clearly below the margin."""
    if e2e.rounds_together([config, float32]) < MIN_PAIRED_ROUNDS:
        return False
    return e2e.speedup(config, float32).high < ctx.min_speedup


def choose(ctx: Context, latency: LatencyProfile, tried: list[Configuration], uniform_configs: list[Configuration],
           models: Models, e2e: EndToEnd) -> tuple[Configuration, list[Configuration], int, list[str]]:
    """Times every configuration together (paired rounds in steps of half the repeats, up to
    twice the repeats; after each step only float32 and the configurations whose speed-up over
    it is not yet clearly on one side of the margin, until none is, and from the first step
    none that the calibration rounds already put clearly below it: see :func:`unsettled`),
    scores the uniform policies that could matter, and decides with confidence (:func:`decide`).

    Returns the winner, every configuration (maps, then uniform policies, with their
    end-to-end figures), the evaluations spent only to report the best uniform policy, and the
    decision log.
    """
    group = e2e.time_until(tried + uniform_configs, 2 * ctx.repeats, max(ctx.repeats // 2, 1),
                           lambda: unsettled(ctx, e2e, uniform_configs[0], tried + uniform_configs[1:]), "final",
                           first=True)
    grouped = len(e2e.rounds)  # the group's rounds end here; close calls' extra rounds follow
    if e2e.failure(uniform_configs[0]):  # every speed-up is measured against it
        raise ValueError(f"The float32 model could not be timed end to end: {e2e.failure(uniform_configs[0])}")
    float32 = _timed(e2e, uniform_configs[0], uniform_configs[0])
    tried = [_timed(e2e, c, float32) for c in tried]
    timed_uniforms = [_timed(e2e, c, float32) for c in uniform_configs]
    best_map = min((e.measured_latency_s for e in tried if e.meets_budget and not e.excluded), default=math.inf)
    report_only = 0
    # A uniform policy needs its metric if it could beat the map on latency (a decision), or
    # if it is faster than float32 (to report the best uniform policy honestly).
    for i, u in enumerate(timed_uniforms):
        if (u.metric is None and not u.disqualified and not u.excluded
                and u.measured_latency_s < max(best_map, float32.measured_latency_s)):
            before = ctx.scorer.evaluations
            try:
                timed_uniforms[i] = u.with_(metric=_evaluate(ctx, u.name, u.policy_map, models[u.name]))
            except Exception as e:  # pylint: disable=broad-except
                timed_uniforms[i] = u.with_(metric=math.nan, excluded=failed("evaluate", e))
            if u.measured_latency_s >= best_map:
                report_only += ctx.scorer.evaluations - before
    timed_uniforms = [u.with_(meets_budget=None if u.metric is None else ctx.budget.meets(u.metric) and not u.disqualified)
                      for u in timed_uniforms]
    contenders = [c for c in tried + timed_uniforms[1:] if c.meets_budget and not c.excluded]
    eligible = ([] if float32.excluded else [timed_uniforms[0]]) + contenders
    # The decision is cached with its rounds: a rerun reaches the same one without timing. Its
    # key names the configurations that could be chosen, so a rerun under another memory or
    # accuracy budget (the same maps timed, others excluded) decides again.
    decision_key = key(group, "decision", ctx.min_speedup, ctx.confirm_seconds,
                       sorted((c.name, config_key(c)) for c in eligible))
    cached = ctx.cache.lookup(decision_key)
    # The extra rounds are kept with the decision, not with the group: a rerun must read the same
    # group rounds as this run did before deciding (which uniform policies it scores depends on
    # them), then adds the extra rounds for the same figures.
    winner = next((c for c in eligible if cached is not None and c.name == cached["winner"]), None)
    if winner is not None:
        log = cached["log"]
        e2e.rounds += [dict(r) for r in cached.get("extra_rounds", [])]
    else:
        winner, log = decide(ctx, e2e, timed_uniforms[0], contenders, tried + timed_uniforms[1:])
        ctx.cache.put(decision_key, {"winner": winner.name, "log": log, "extra_rounds": e2e.rounds[grouped:]},
                      share=True)
        ctx.cache.flush()
    # Extra rounds changed the pairs they timed: refresh every figure from all rounds.
    entries = [_timed(e2e, c, timed_uniforms[0]) for c in tried + timed_uniforms]
    winner = next(e for e in entries if e.name == winner.name)
    return winner, entries, report_only, log


#: A set of kernels is timed end to end only where the layers' own timings put it within this
#: factor of the kernels they chose: timed alone, a layer's weights stay in the caches, which
#: misleads by tens of percent (a decoder at batch 1 streams them), not by more.
KERNEL_SETS_WITHIN = 1.5


def kernel_sets(latency: LatencyProfile, winner: Configuration,
                choice: Mapping[str, Mapping[str, str]]) -> list[tuple[str, dict[str, str], float]]:
    """The kernel sets worth timing end to end for ``winner``'s map: for each kernel that its
    layers' tactics name, that kernel on every layer that timed it (the others keep their own).

    Returns ``(kernel, {path: kernel} of the layers it changes, its layers' summed seconds over
    those of the kernels chosen)`` for each set that changes a layer and is within
    :data:`KERNEL_SETS_WITHIN`, fastest first.
    """
    timed: dict[str, tuple[str, dict[str, float]]] = {}
    for path, name in winner.assignment.items():
        kernel = choice.get(path, {}).get(name)
        tactics = dict(latency.timing(path, name).tactics) if kernel else {}
        if kernel in tactics:
            timed[path] = (kernel, tactics)
    if not timed:
        return []
    chosen = sum(tactics[kernel] for kernel, tactics in timed.values())
    sets = []
    for other in sorted({k for _, tactics in timed.values() for k in tactics}):
        changed = {p: other for p, (kernel, tactics) in timed.items() if other in tactics and kernel != other}
        if not changed:
            continue
        seconds = sum(tactics[changed.get(p, kernel)] for p, (kernel, tactics) in timed.items())
        if seconds <= KERNEL_SETS_WITHIN * chosen:
            sets.append((other, changed, seconds / chosen))
    return sorted(sets, key=lambda s: s[2])


def confirm_kernels(ctx: Context, latency: LatencyProfile, winner: Configuration, float32: Configuration,
                    models: Models, e2e: EndToEnd,
                    choice: Mapping[str, Mapping[str, str]]) -> tuple[Configuration, list[str]]:
    """The winner's kernels, confirmed end to end: each set of :func:`kernel_sets` runs the
    winner's map in paired rounds with it (and float32, for the figures), in steps of half the
    repeats up to twice the repeats, until every set's speed-up over the winner is clearly on
    one side of 1. A set faster with confidence replaces the kernels timed fastest alone (the
    fastest such set); the winner keeps its name and metric (the kernels compute the same
    quantized product: int8 bit for bit, int4 blocks within float32 rounding) and takes the
    set's figures.

    ``choice`` is the adapter's kernel choice (``profiling.kernel_choice``); the adapter is
    left with it. Returns the winner, and one decision line per set timed.
    """
    sets = kernel_sets(latency, winner, choice) if not winner.excluded else []
    if not sets:
        return winner, []
    log, variants = [], []
    for kernel, changed, ratio in sets:
        variant = winner.with_(name=f"{winner.name} on {kernel}", kernels=tuple(sorted(changed.items())))
        every = {p: dict(by_policy) for p, by_policy in choice.items()}
        for path, k in changed.items():
            every[path][winner.assignment[path]] = k
        try:
            ctx.adapter.use_kernels(every)
            failure = _build(ctx, models, variant)
        finally:
            ctx.adapter.use_kernels(choice)
        if failure:
            log.append(f"kernels: {variant.name} {failure}")
        else:
            variants.append((variant, kernel, len(changed), ratio))
    configs = [float32, winner] + [v[0] for v in variants]

    def pending() -> list[Configuration]:
        timed = [c for c in configs if not e2e.failure(c)]
        if e2e.rounds_together(timed) < MIN_PAIRED_ROUNDS:
            return timed
        open_ = [v for v in timed[2:] if e2e.speedup(v, winner).straddles(1.0)]
        return [float32, winner] + open_ if open_ else []

    if variants:
        e2e.time_until(configs, 2 * ctx.repeats, max(ctx.repeats // 2, 1), pending, "kernels")
    best: tuple[Configuration, Speedup] | None = None
    for variant, kernel, count, ratio in variants:
        if e2e.failure(variant) or e2e.failure(winner):
            log.append(f"kernels: {variant.name} not compared ({e2e.failure(variant) or e2e.failure(winner)})")
            continue
        speedup = e2e.speedup(variant, winner)
        verdict = "replaces" if speedup.clears(1.0) else "does not replace"
        log.append(f"kernels: {kernel} on {count} more layer(s) (timed alone {ratio:.3f}x the seconds) {verdict} "
                   f"the kernels timed fastest alone in {winner.name}: {speedup}")
        if speedup.clears(1.0) and (best is None or speedup.median > best[1].median):
            best = (variant, speedup)
    for variant, *_ in variants:
        model = models.pop(variant.name, None)
        if best is not None and variant is best[0]:
            models[winner.name] = model
    if best is None:
        return winner, log
    return _timed(e2e, best[0].with_(name=winner.name), float32), log
