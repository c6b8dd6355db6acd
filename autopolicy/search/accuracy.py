"""Phase 2, accuracy: each layer switched alone to each candidate (the rest float32), scored."""

from __future__ import annotations

import concurrent.futures
import math
import os
from typing import Any

from autopolicy import policies
from autopolicy.search import executor
from autopolicy.search._context import Context
from autopolicy.search._defaults import REFERENCE
from autopolicy.search._progress import progress as bar
from autopolicy.search.cache import key
from autopolicy.search.phases import AccuracyProfile, Configuration, LatencyProfile, LayerAccuracy, Site, Status

__all__ = ["dominated", "measure_accuracy", "skipped_accuracy", "estimate_accuracy"]


def _reference(baseline: float) -> LayerAccuracy:
    return LayerAccuracy(Status.REFERENCE, metric=baseline, cost=0.0, sqnr_db=math.inf, kl=0.0)


def dominated(latency: LatencyProfile, i: int, policy: policies.DTypePolicy, memory_bound: bool = False) -> bool:
    """Slower than float32 by more than any cast it could save, and (under a memory budget,
    ``memory_bound``) no smaller: never chosen by the solver. A slower candidate that stores
    fewer bytes may be the only way to fit the budget (an int8 embedding: a slower gather)."""
    sites = latency.sites
    site, table = sites[i], latency.timings[sites[i].path]
    if memory_bound and table[policy.name].nbytes < table[REFERENCE].nbytes:
        return False
    slack = max([s for (a, b), s in latency.site_casts(site).items() if b == REFERENCE] + [0.0])
    if i + 1 < len(sites) and sites[i + 1].chained:
        slack += max([s for (a, b), s in latency.site_casts(sites[i + 1]).items() if a == REFERENCE] + [0.0])
    return latency.latency_s(site, policy.name) - latency.latency_s(site, REFERENCE) > slack


def skipped_accuracy(ctx: Context, latency: LatencyProfile) -> AccuracyProfile:
    """No layer scored: the fastest assignment met the budget, so costs cannot change the choice."""
    entries = {}
    for site in latency.sites:
        table = {REFERENCE: _reference(ctx.budget.baseline_metric)}
        for policy in site.candidates[1:]:
            finite = latency.timing(site.path, policy.name).finite
            table[policy.name] = LayerAccuracy(Status.NOT_NEEDED if finite else Status.NONFINITE_LAYER)
        entries[site.path] = table
    return AccuracyProfile(entries, method="skipped", evaluations=0)


def _cache_key(ctx: Context, site_path: str, policy_name: str) -> str:
    return key(ctx.fingerprint, "accuracy", ctx.digest, site_path, policy_name)


def _entry(ctx: Context, scored: dict) -> LayerAccuracy:
    fields = {k: scored[k] for k in ("metric", "sqnr_db", "kl")}
    proxy = scored.get("proxy", "")
    if not scored["finite"]:
        return LayerAccuracy(Status.NONFINITE_MODEL, proxy=proxy, **fields)
    return LayerAccuracy(Status.MEASURED, cost=max(0.0, ctx.budget.drop(scored["metric"])), proxy=proxy,
                         **fields)


def _failed(error: str) -> LayerAccuracy:
    return LayerAccuracy(f"{Status.FAILED} ({error})")


def _score(ctx: Context, site: Site, policy: policies.DTypePolicy, model: Any = None) -> LayerAccuracy:
    try:  # a model that fails to build, run or be scored disqualifies the candidate (not cached)
        scored = ctx.cache.get_or_measure(_cache_key(ctx, site.path, policy.name),
                                          lambda: executor.score(ctx.adapter, ctx.scorer, site.path, policy.name, model))
    except Exception as e:  # pylint: disable=broad-except
        return _failed(f"{type(e).__name__}: {str(e)[:200]}")
    ctx.cache.flush()
    return _entry(ctx, scored)


def _score_here(ctx: Context, todo: list[tuple[Site, policies.DTypePolicy]],
                entries: dict[str, dict[str, LayerAccuracy]]) -> None:
    """Scores ``todo`` one after another, each candidate's model compiled in the background while
    the one before it is scored (:meth:`Scorer.prefetch`; on two cores a MiniLM candidate took
    about 1 s to compile and 1.4 s to score), where the adapter's program can be lowered ahead.
    Models compiled by parts (the nn adapter's ``scoring_model``) have no such program: their
    new parts compile as they run, the others are compiled already."""
    ahead: dict[int, tuple[Any, concurrent.futures.Future | None]] = {}  # index -> (model, compiling)

    def prepare(j: int) -> None:
        if j >= len(todo) or j in ahead or _cache_key(ctx, todo[j][0].path, todo[j][1].name) in ctx.cache:
            return
        try:
            model = executor.candidate_model(ctx.adapter, todo[j][0].path, todo[j][1].name)
            ahead[j] = (model, ctx.scorer.prefetch(model))
        except Exception:  # pylint: disable=broad-except  # fails again when scored, and is disqualified there
            ahead[j] = (None, None)

    try:
        for i, (site, policy) in enumerate(bar(ctx.progress, todo, "sensitivity", len(todo))):
            prepare(i)
            prepare(i + 1)
            model, compiling = ahead.pop(i, (None, None))
            if compiling is not None:
                concurrent.futures.wait([compiling])  # a failed compilation fails again when scored
            entries[site.path][policy.name] = _score(ctx, site, policy, model)
    finally:
        for _, compiling in ahead.values():
            if compiling is not None:
                compiling.cancel()


def _score_on_executor(ctx: Context, todo: list[tuple[Site, policies.DTypePolicy]],
                       entries: dict[str, dict[str, LayerAccuracy]]) -> int:
    """Scores ``todo`` on ``ctx.executor`` (those cached already are read from the cache);
    returns the evaluations the workers made."""
    missing = []
    for site, policy in todo:
        cached = ctx.cache.lookup(_cache_key(ctx, site.path, policy.name))
        if cached is not None:
            entries[site.path][policy.name] = _entry(ctx, cached)
        else:
            missing.append((site.path, policy.name))
    if not missing:
        return 0
    sites = {site.path: site for site, _ in todo}
    target = executor.numerics_fingerprint()
    directory = os.path.dirname(ctx.cache.path) if ctx.cache.path else None
    ref, remove = executor.share(ctx.workload, directory)
    evaluations = 0

    def local(path: str, name: str) -> None:  # a task the workers could not run: scored here
        entries[path][name] = _score(ctx, sites[path], policies.get(name))

    try:
        results = executor.scores(ctx.executor, ref, missing, local)
        for (path, name), figures, where in bar(ctx.progress, results, "sensitivity (workers)", len(missing)):
            if where == "target":
                continue
            evaluations += figures["evaluations"]
            if "error" in figures:  # the candidate failed on the worker: disqualified, not cached
                entries[path][name] = _failed(figures["error"])
                continue
            proxy = executor.describe_numerics(figures["numerics"], target)
            scored = {k: figures[k] for k in ("metric", "sqnr_db", "kl", "finite")}
            if proxy:
                scored["proxy"] = proxy
            ctx.cache.put(_cache_key(ctx, path, name), scored)
            ctx.cache.flush()
            entries[path][name] = _entry(ctx, scored)
    finally:
        remove()
    return evaluations


def measure_accuracy(ctx: Context, latency: LatencyProfile, every_candidate: bool = False) -> AccuracyProfile:
    """Phase 2: the accuracy cost of every layer under every candidate it could be given.

    A candidate whose layer output is not finite is disqualified; one slower than float32 by
    more than any cast it could save (and, under a memory budget, no smaller) is skipped (the
    solver would never choose it), unless ``every_candidate`` asks for a complete sensitivity
    table. With ``ctx.executor``, the
    evaluations run there (:mod:`autopolicy.search.executor`), their results identical.
    """
    before = ctx.scorer.evaluations
    entries = {site.path: {REFERENCE: _reference(ctx.budget.baseline_metric)} for site in latency.sites}
    todo = []
    for i, site in enumerate(latency.sites):
        for policy in site.candidates[1:]:
            if not latency.timing(site.path, policy.name).finite:
                entries[site.path][policy.name] = LayerAccuracy(Status.NONFINITE_LAYER)
            elif not every_candidate and dominated(latency, i, policy, ctx.budget.memory_budget is not None):
                entries[site.path][policy.name] = LayerAccuracy(Status.SLOWER)
            else:
                todo.append((site, policy))
    remote = 0
    if ctx.executor is not None:
        remote = _score_on_executor(ctx, todo, entries)
    else:
        _score_here(ctx, todo, entries)
    # Every table in the order of the sites' candidates, however the results arrived.
    entries = {site.path: {p.name: entries[site.path][p.name] for p in site.candidates} for site in latency.sites}
    return AccuracyProfile(entries, method="measured", evaluations=ctx.scorer.evaluations - before + remote,
                           remote=remote)


def estimate_accuracy(ctx: Context, latency: LatencyProfile, observed: Configuration) -> AccuracyProfile | None:
    """Per-layer costs estimated without scoring a layer: each candidate's relative output
    error at its layer (measured with its latency), times one scale fitted so that the changed
    layers of ``observed`` (a map scored end to end) add up to its observed drop (a rise, for a
    lower-is-better metric: every cost is read in the metric's direction).

    Returns None when no scale can be fitted (the observed map lost nothing, or its layers'
    errors are unknown or zero).
    """
    drop = ctx.budget.drop(observed.metric) if observed.metric is not None else math.nan
    errors = [latency.timing(p, n).output_error for p, n in observed.changed.items()]
    total = sum(errors)
    if not (math.isfinite(drop) and drop > 0 and math.isfinite(total) and total > 0):
        return None
    scale = drop / total
    entries = {}
    for site in latency.sites:
        table = {REFERENCE: _reference(ctx.budget.baseline_metric)}
        for policy in site.candidates[1:]:
            t = latency.timing(site.path, policy.name)
            if not t.finite:
                table[policy.name] = LayerAccuracy(Status.NONFINITE_LAYER)
            elif not math.isfinite(t.output_error):
                table[policy.name] = LayerAccuracy(Status.NOT_ESTIMATED)
            else:
                table[policy.name] = LayerAccuracy(Status.ESTIMATED, cost=scale * t.output_error)
        entries[site.path] = table
    return AccuracyProfile(entries, method="estimated", evaluations=0, scale=scale)
