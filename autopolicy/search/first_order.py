"""Phase 2 without scoring a layer: the first-order (gradient x quantization error) estimate.

A candidate policy changes a layer's output ``y`` by an error ``e`` (its output under the policy
minus its float32 output, on the same inputs). With ``g`` the gradient of a differentiable loss
``L`` (the mean of ``N`` per-example losses) with respect to ``y``, a Taylor expansion gives the
loss's change:

- the first-order term ``<g, e>``;
- the Fisher term ``0.5 * N * sum(g**2 * e**2)``: the second-order term with the Hessian
  replaced by the diagonal of the empirical Fisher, ``(1/N) sum_n grad(l_n) grad(l_n)^T``, each
  example's gradient approximated by ``N * g`` where it touches the output (exact when each
  output row feeds one example's loss). At a trained model the first-order term averages to
  about zero over inputs, so this one is the usual sensitivity measure.

Which of them ranks single layers best was measured by rank correlation with one-layer
perplexity changes of SmolLM2-135M (``benchmarks/bench_first_order.py``,
``reports/first-order-smollm2-amd-epyc-avx2-2c.md``): with the gradient taken on the very windows the metric
scores, their sum ranks 32 layer/candidate pairs with Spearman 0.87 (the Fisher term alone 0.66,
the first-order term alone 0.67): on the metric's own data the first-order term is not zero, it
is the sign-indefinite part of each change. On 4 windows disjoint from the scored ones the
Fisher term alone ranked best (0.65; the sum 0.61), so give ``loss_inputs`` the metric's own
batches where they are at hand.

A solver, though, does not rank: it collects every layer whose cost looks small, and a
negative first-order term makes a layer look free. On SmolLM2-135M the sum, clipped at zero,
left 44 of 211 layers free under int4 in blocks of 128, 72 under int8 and 99 under gptq/8, and
the maps solved within a 0.48 perplexity budget rose it 1.8x more than predicted, twice (0.48
predicted, 0.85 measured; then 0.27 and 0.49). So :data:`ESTIMATOR`, what the
search uses, is ``"cautious"``: the Fisher term plus the first-order term where it is positive
(no layer is credited for improving the loss alone). Every figure comes from one forward and
backward pass per calibration batch, plus one run of each layer under each candidate on the
inputs that pass recorded: no metric evaluation. :func:`calibrate` then scales each
candidate's costs so that they add up to its uniform policy's measured change, where the
search has scored it.

The loss change is turned into the metric's units by :data:`LINKS`: ``"exp"`` for a perplexity
(``exp`` of a mean negative log-likelihood: a change ``dL`` multiplies it by ``exp(dL)``),
``"loss"`` for a metric that is the loss itself, ``"fitted"`` for any other metric (one scale
fitted so that the changed layers of a map scored end to end add up to its observed drop).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from autopolicy import policies
from autopolicy.search._context import Context
from autopolicy.search._defaults import REFERENCE
from autopolicy.search._progress import progress as bar
from autopolicy.search.accuracy import dominated
from autopolicy.search.adapter import FIRST_ORDER_METHODS, digest_arrays, supports_first_order
from autopolicy.search.cache import MeasurementCache, key
from autopolicy.search.phases import AccuracyProfile, Configuration, LatencyProfile, LayerAccuracy, Status

__all__ = ["LINKS", "TERMS", "ESTIMATOR", "batch_terms", "measure_terms", "combine", "loss_change", "metric_cost",
           "estimate", "calibrate", "check_arguments"]

#: How a loss change becomes a change of the metric (see the module docstring).
LINKS = ("exp", "loss", "fitted")
#: The estimates of a loss change: the first-order term, the Fisher term, their sum, or the
#: Fisher term plus the first-order term's positive part.
TERMS = ("first", "fisher", "both", "cautious")
#: The one the search uses (see the module docstring).
ESTIMATOR = "cautious"

Pair = tuple[str, policies.DTypePolicy]


def _sums(gradients: Sequence[tuple], outputs: Sequence[tuple], reference: Sequence[tuple]) -> dict[str, Any]:
    """Over every call and output leaf, in float64: ``<g, e>``, ``sum(g^2 e^2)``, the reference's
    and the error's squared sums, and whether the outputs are finite."""
    dot = square = signal = noise = 0.0
    for grads, outs, refs in zip(gradients, outputs, reference):
        for g, y, r in zip(grads, outs, refs):
            y64, r64 = np.asarray(y, np.float64).ravel(), np.asarray(r, np.float64).ravel()
            if not np.all(np.isfinite(y64)):
                return {"finite": False}
            e, g64 = y64 - r64, np.asarray(g, np.float64).ravel()
            dot += float(np.dot(g64, e))
            square += float(np.dot(g64 * g64, e * e))
            signal += float(np.dot(r64, r64))
            noise += float(np.dot(e, e))
    return {"finite": True, "dot": dot, "square": square, "signal": signal, "noise": noise}


def batch_terms(adapter: Any, captured: Any, pairs: Sequence[Pair],
                done: Callable[[Pair, dict], None] = lambda pair, record: None, progress: bool = False) -> dict:
    """One batch's sums for every (layer path, policy) of ``pairs`` from ``captured`` (the
    adapter's :class:`~autopolicy.search.adapter.OutputGradients` of that batch); each record
    also holds the batch's ``examples``. ``done(pair, record)`` is called as each is ready."""
    out, reference_path, reference = {}, None, None
    float32 = policies.get(REFERENCE)
    for path, policy in bar(progress, pairs, "first-order", len(pairs)):
        if path != reference_path:  # pairs come grouped by layer: its float32 outputs once
            reference_path, reference = path, adapter.layer_outputs(path, float32, captured)
        outputs = adapter.layer_outputs(path, policy, captured)
        record = {**_sums(captured.gradients.get(path, ()), outputs, reference), "examples": captured.examples}
        out[(path, policy.name)] = record
        done((path, policy), record)
    return out


def combine(records: Iterable[dict]) -> dict[str, float | bool]:
    """One pair's terms over its batches' records (:func:`batch_terms`), for the loss that is the
    mean over all their examples: ``first`` (``sum_b w_b <g_b, e_b>``, ``w_b = N_b / N``),
    ``fisher`` (``0.5 * sum_b w_b N_b sum(g_b^2 e_b^2)``) and ``sqnr_db``.

    >>> combine([{"finite": True, "dot": 0.5, "square": 2.0, "signal": 4.0, "noise": 0.04, "examples": 10}])
    {'finite': True, 'first': 0.5, 'fisher': 10.0, 'sqnr_db': 20.0}
    """
    records = list(records)
    if not all(r["finite"] for r in records):
        return {"finite": False, "first": math.nan, "fisher": math.nan, "sqnr_db": math.nan}
    total = sum(r["examples"] for r in records)
    first = sum(r["examples"] * r["dot"] for r in records) / total
    fisher = 0.5 * sum(r["examples"] ** 2 * r["square"] for r in records) / total
    signal, noise = sum(r["signal"] for r in records), sum(r["noise"] for r in records)
    sqnr = math.inf if noise == 0 else 10.0 * math.log10(max(signal, 1e-300) / noise)
    return {"finite": True, "first": first, "fisher": fisher, "sqnr_db": sqnr}


def loss_change(terms: dict, estimator: str = ESTIMATOR) -> float:
    """The estimated change of the loss from :func:`combine`'s terms, by ``estimator``.

    >>> terms = {"first": -0.3, "fisher": 0.2}
    >>> round(loss_change(terms, "both"), 6), loss_change(terms, "cautious")
    (-0.1, 0.2)

    Raises:
      ValueError: for an estimator not in :data:`TERMS`.
    """
    if estimator not in TERMS:
        raise ValueError(f"estimator must be one of {list(TERMS)}. Received: estimator={estimator!r}")
    if estimator == "both":
        return terms["first"] + terms["fisher"]
    if estimator == "cautious":
        return max(terms["first"], 0.0) + terms["fisher"]
    return terms[estimator]


def metric_cost(change: float, link: str, baseline: float, scale: float = 1.0) -> float:
    """A loss change as the metric's worsening (>= 0) under ``link`` (:data:`LINKS`); ``baseline``
    is the float32 metric, ``scale`` the fitted scale of ``"fitted"``.

    >>> round(metric_cost(0.01, "exp", 20.0), 4), metric_cost(-0.5, "loss", 3.0)
    (0.201, 0.0)
    """
    if link == "exp":
        cost = baseline * math.expm1(change)
    elif link == "loss":
        cost = change
    elif link == "fitted":
        cost = scale * change
    else:
        raise ValueError(f"loss_link must be one of {list(LINKS)}. Received: loss_link={link!r}")
    return max(0.0, cost)


def _key(ctx: Context, loss_name: str, batch: str, path: str, policy: str) -> str:
    return key(ctx.fingerprint, "first_order", ctx.digest, loss_name, batch, path, policy)


def _pairs(ctx: Context, latency: LatencyProfile) -> tuple[list[Pair], dict[str, dict[str, LayerAccuracy]]]:
    """The (path, policy) pairs to estimate, and the tables with what needs no estimate."""
    entries: dict[str, dict[str, LayerAccuracy]] = {}
    pairs: list[Pair] = []
    for i, site in enumerate(latency.sites):
        entries[site.path] = {REFERENCE: LayerAccuracy(Status.REFERENCE, metric=ctx.budget.baseline_metric,
                                                       cost=0.0, sqnr_db=math.inf, kl=0.0)}
        for policy in site.candidates[1:]:
            if not latency.timing(site.path, policy.name).finite:
                entries[site.path][policy.name] = LayerAccuracy(Status.NONFINITE_LAYER)
            elif dominated(latency, i, policy, ctx.budget.memory_budget is not None):
                entries[site.path][policy.name] = LayerAccuracy(Status.SLOWER)
            else:
                pairs.append((site.path, policy))
    return pairs, entries


def measure_terms(adapter: Any, cache: MeasurementCache, keyed: Callable[[int, str, str], str], loss_fn: Callable,
                  batches: Sequence[tuple], pairs: Sequence[Pair], progress: bool = False) -> dict:
    """``(path, policy name) -> [record per batch]``, from ``cache`` where ``keyed(batch index,
    path, policy name)`` is there; a batch with any pair missing gets its backward pass, and each
    new record is cached (flushed as each layer completes, so a killed run resumes)."""
    records: dict[tuple[str, str], list] = {(p, q.name): [] for p, q in pairs}
    for b, batch in enumerate(batches):
        missing = []
        for path, policy in pairs:
            cached = cache.lookup(keyed(b, path, policy.name))
            if cached is None:
                missing.append((path, policy))
            else:
                records[(path, policy.name)].append(cached)
        if not missing:
            continue
        captured = adapter.output_gradients(loss_fn, batch)
        state = {"path": None}

        def done(pair: Pair, record: dict, b=b) -> None:
            if state["path"] not in (None, pair[0]):
                cache.flush()
            state["path"] = pair[0]
            cache.put(keyed(b, pair[0], pair[1].name), record)
            records[(pair[0], pair[1].name)].append(record)

        batch_terms(adapter, captured, missing, done, progress)
        cache.flush()
        del captured
    return records


def _fitted_scale(ctx: Context, changes: dict[tuple[str, str], float], observed: Configuration | None) -> float | None:
    """The metric worsening per unit of loss change that makes ``observed``'s changed layers add
    up to its observed drop (None when it cannot be fitted)."""
    if observed is None or observed.metric is None:
        return None
    drop = ctx.budget.drop(observed.metric)
    total = sum(max(0.0, changes.get((p, n), math.nan)) for p, n in observed.changed.items())
    if not (math.isfinite(drop) and drop > 0 and math.isfinite(total) and total > 0):
        return None
    return drop / total


def estimate(ctx: Context, latency: LatencyProfile, loss_fn: Callable, link: str, batches: Sequence[tuple],
             observed: Configuration | None = None) -> AccuracyProfile | None:
    """Every layer's cost under every candidate it could be given, in the metric's units, from
    the first-order estimate of ``loss_fn`` on ``batches`` (cached in the run's cache, per batch
    by its contents).

    A candidate whose layer output is not finite is disqualified; one slower than float32 by
    more than any cast it could save (and, under a memory budget, no smaller) is skipped (the
    solver would never choose it). Returns
    None when ``link`` is ``"fitted"`` and no scale can be fitted from ``observed``.
    """
    pairs, entries = _pairs(ctx, latency)
    loss_name = getattr(loss_fn, "__qualname__", repr(loss_fn))
    digests = [digest_arrays(batch) for batch in batches]
    keyed = lambda b, path, name: _key(ctx, loss_name, digests[b], path, name)  # noqa: E731
    records = measure_terms(ctx.adapter, ctx.cache, keyed, loss_fn, batches, pairs, ctx.progress)
    terms = {pair: combine(rs) for pair, rs in records.items()}
    changes = {pair: loss_change(t) for pair, t in terms.items() if t["finite"]}
    scale = 1.0
    if link == "fitted":
        scale = _fitted_scale(ctx, changes, observed)
        if scale is None:
            return None
    for (path, name), t in terms.items():
        if not t["finite"]:
            entries[path][name] = LayerAccuracy(Status.NONFINITE_LAYER)
            continue
        cost = metric_cost(changes[(path, name)], link, ctx.budget.baseline_metric, scale)
        entries[path][name] = LayerAccuracy(Status.FIRST_ORDER, cost=cost, sqnr_db=t["sqnr_db"])
    entries = {s.path: {p.name: entries[s.path][p.name] for p in s.candidates} for s in latency.sites}
    return AccuracyProfile(entries, method="first_order", evaluations=0, scale=scale if link == "fitted" else None)


def calibrate(profile: AccuracyProfile, link: str, baseline: float, observed: Mapping[str, float]) -> AccuracyProfile:
    """``profile`` with each candidate's estimated costs scaled so that they add up to what its
    uniform policy measured end to end: ``observed`` maps a policy name to the metric's change
    with every layer on it (in the metric's bad direction, as ``Budget.drop`` gives it).

    One scale per candidate, fitted where the estimate is additive: in the loss for the
    ``"exp"`` link (a cost ``c`` is the loss change ``log1p(c / baseline)``, and a rise ``r`` of
    the uniform policy is ``log1p(r / baseline)``), in the metric's units otherwise. A change of
    zero or less gives the scale 0 (the candidate's layers cost nothing, as its uniform policy
    showed); a candidate with no finite observation, or whose estimates add up to 0, keeps its
    estimates. The scales are recorded in the profile's ``scales``.

    >>> entries = {"a": {"p": LayerAccuracy(Status.FIRST_ORDER, cost=1.0)},
    ...            "b": {"p": LayerAccuracy(Status.FIRST_ORDER, cost=3.0)}}
    >>> out = calibrate(AccuracyProfile(entries, "first_order", 0), "loss", 10.0, {"p": 2.0})
    >>> out.scales, out.get("a", "p").cost, out.get("b", "p").cost
    ({'p': 0.5}, 0.5, 1.5)
    """
    def to_loss(cost: float) -> float:
        return math.log1p(cost / baseline) if link == "exp" else cost

    def from_loss(change: float) -> float:
        return baseline * math.expm1(change) if link == "exp" else change

    scales: dict[str, float] = {}
    for name, drop in observed.items():
        usable = [acc for row in profile.entries.values() for n, acc in row.items()
                  if n == name and acc.status == Status.FIRST_ORDER and math.isfinite(acc.cost)]
        total = sum(to_loss(acc.cost) for acc in usable)
        if not math.isfinite(drop) or not usable or total <= 0 or (link == "exp" and drop <= -baseline):
            continue
        scales[name] = max(to_loss(drop), 0.0) / total
    entries = {path: {name: (dataclasses.replace(acc, cost=from_loss(scales[name] * to_loss(acc.cost)))
                             if name in scales and acc.status == Status.FIRST_ORDER and math.isfinite(acc.cost) else acc)
                      for name, acc in row.items()}
               for path, row in profile.entries.items()}
    return dataclasses.replace(profile, entries=entries, scales=scales or None)


def check_arguments(profile_accuracy: str, loss_fn: Any, loss_link: str, higher_is_better: bool,
                    adapter: Any = None) -> None:
    """Checks ``tune``'s ``loss_fn`` and ``loss_link`` against ``profile_accuracy``.

    Raises:
      ValueError: for ``profile_accuracy="first_order"`` without a ``loss_fn`` or with an
        adapter that cannot take gradients (:data:`~autopolicy.search.adapter.FIRST_ORDER_METHODS`),
        a ``loss_link`` not in :data:`LINKS`, or a link that reads the metric as a loss
        (``"exp"``, ``"loss"``) with a higher-is-better metric.
      TypeError: for a ``loss_fn`` that is not callable.

    >>> check_arguments("first_order", None, "exp", False)
    Traceback (most recent call last):
    ...
    ValueError: profile_accuracy='first_order' needs loss_fn=loss_fn(model, *batch) -> per-example losses (a differentiable loss, e.g. next-token cross-entropy). Received: loss_fn=None
    """
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function loss_fn(model, *batch) -> per-example losses, or None. "
                        f"Received: loss_fn={loss_fn!r}")
    if profile_accuracy == "first_order" and loss_fn is None:
        raise ValueError("profile_accuracy='first_order' needs loss_fn=loss_fn(model, *batch) -> per-example losses "
                         "(a differentiable loss, e.g. next-token cross-entropy). Received: loss_fn=None")
    if loss_link not in LINKS:
        raise ValueError(f"loss_link must be one of {list(LINKS)}. Received: loss_link={loss_link!r}")
    if loss_link in ("exp", "loss") and higher_is_better:
        raise ValueError(f"loss_link={loss_link!r} reads the metric as {'exp(loss)' if loss_link == 'exp' else 'the loss'}"
                         ", which is lower-is-better, but higher_is_better=True: pass higher_is_better=False or "
                         "loss_link='fitted'.")
    if profile_accuracy == "first_order" and adapter is not None and not supports_first_order(adapter):
        raise ValueError(f"profile_accuracy='first_order' needs an adapter with {list(FIRST_ORDER_METHODS)}; "
                         f"{type(adapter).__name__} has not. Use profile_accuracy='auto' or 'measure'.")
