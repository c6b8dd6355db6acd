"""``tune``: measure every layer under every candidate policy on this machine, solve for the
fastest per-layer assignment within an accuracy budget, verify it end to end, emit the map."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np

from autopolicy import _json, _multihost, policies
from autopolicy.search import (_checks, accuracy as accuracy_phase, executor as executor_mod, first_order, hardware,
                               latency_model, noise, profiling, timing, verify, workload as workload_mod)
from autopolicy.search.costs import Costs, phase
from autopolicy.search._context import Context
from autopolicy.search._defaults import DEFAULT_CANDIDATES, REFERENCE
from autopolicy.search.adapter import AdapterFactory, digest_arrays, get_adapter, supports_first_order, supports_kernels
from autopolicy.search.cache import MeasurementCache, key
from autopolicy.search.endtoend import EndToEnd
from autopolicy.search.phases import Budget
from autopolicy.search.result import TuneResult
from autopolicy.search.sensitivity import Scorer

__all__ = ["tune", "DEFAULT_CANDIDATES"]

PROFILE_ACCURACY = ("auto", "first_order", "measure", "always")


def _reference(made: Any, eval_fn: Callable[[Any], float], calibration: list[tuple]) -> tuple[Any, Scorer]:
    """The float32 model and the scorer holding its outputs: every figure is compared with them,
    so a float32 model that fails to build or run stops the search (other configurations that
    fail are excluded instead)."""
    try:
        model = made.with_policies(policies.DTypePolicyMap(REFERENCE))
        return model, Scorer(eval_fn, calibration, made, model)
    except Exception as e:  # pylint: disable=broad-except
        raise ValueError(f"The float32 model failed to build or run: {type(e).__name__}: {e}") from e


def _test_metrics(test_fn: Callable[[Any], float] | None, reference: Any, chosen: Any) -> dict | None:
    """``test_fn`` on float32 (a finite number) and on the chosen model (reported as it is)."""
    if test_fn is None:
        return None
    return {"float32": _checks.check_metric(test_fn(reference), "the float32 model", fn_name="test_fn"),
            "chosen": _checks.check_metric(test_fn(chosen), "the chosen model", finite=False, fn_name="test_fn")}


def _baseline_metric(eval_fn: Callable[[Any], float], model: Any) -> float:
    try:
        value = eval_fn(model)
    except Exception as e:  # pylint: disable=broad-except
        raise ValueError(f"eval_fn raised on the float32 model: {type(e).__name__}: {e}") from e
    return _checks.check_metric(value, "the float32 model")


def _check_memory(latency: Any, memory_budget: float | None) -> None:
    """Refuses a memory budget that no assignment of the candidates can meet, naming the least."""
    if memory_budget is None:
        return
    least = latency.least_nbytes()
    if least > memory_budget:
        raise ValueError(f"memory_budget={memory_budget!r} cannot be met: the tuned layers' weights take at least "
                         f"{least:,} bytes with these candidates (add a smaller one, such as int8_from_float32 or "
                         "int4_from_float32, or raise the budget).")


def _shared_file(shared_cache_dir: str | None) -> str | None:
    if shared_cache_dir is None:
        return None
    return os.path.join(_json.check_path(shared_cache_dir, "shared_cache_dir"), "measurements.json")


def _batches(calibration_inputs: Iterable[Any] | None, args: tuple) -> list[tuple]:
    if calibration_inputs is None:
        return [args]
    batches = [b if isinstance(b, tuple) else (b,) for b in calibration_inputs]
    if not batches:
        raise ValueError("calibration_inputs must hold at least one batch (or be None for [sample_input]).")
    return batches


def _phase_run(model: Any, p: Any, calibration: list, adapter: AdapterFactory | None) -> tuple:
    """``(name, adapter, args, carry, weight)`` of a workload's phase: its own adapter, whose
    layers see the phase's input shapes."""
    try:
        args = _checks.check_sample_input(p.sample_input)
    except (TypeError, ValueError) as e:
        raise type(e)(f"Phase {p.name!r}: {e}") from None
    return p.name, get_adapter(model, args, calibration, adapter), args, p.step_carry, float(p.weight)


def _input_shape(arg: Any) -> list:
    """The shape of one sample-input argument, or of each leaf of a nested one (a language
    model's key/value cache: a tuple of arrays of unlike shapes), for the timings' cache key."""
    if isinstance(arg, (tuple, list, dict)):
        return [list(np.shape(leaf)) for leaf in jax.tree_util.tree_leaves(arg)]
    return list(np.shape(arg))


def tune(
    model: Any,
    eval_fn: Callable[[Any], float],
    sample_input: Any,
    candidates: Sequence[Any] = DEFAULT_CANDIDATES,
    max_drop: float = 0.01,
    relative: bool = True,
    memory_budget: float | None = None,
    cache_dir: str | None = None,
    progress: bool = True,
    calibration_inputs: Iterable[Any] | None = None,
    test_fn: Callable[[Any], float] | None = None,
    repeats: int = 20,
    max_rounds: int = 3,
    min_speedup: float = 1.02,
    profile_accuracy: str = "auto",
    adapter: AdapterFactory | None = None,
    confirm_seconds: float = 30.0,
    shared_cache_dir: str | None = None,
    executor: concurrent.futures.Executor | None = None,
    higher_is_better: bool = True,
    loss_fn: Callable[..., Any] | None = None,
    loss_link: str = "fitted",
    loss_inputs: Iterable[Any] | None = None,
    step_carry: Callable[[tuple, Any], tuple] | None = None,
    workload: Sequence[Any] | None = None,
) -> TuneResult:
    """Finds the fastest per-layer policies on this machine whose metric stays within budget.

    Args:
      model: A built float model: an ``autopolicy.nn`` model, a Keras 3 model (JAX backend), or
        any model with a registered adapter (:func:`autopolicy.search.register_adapter`).
      eval_fn: ``eval_fn(model) -> float``: accuracy on held-out data, or with
        ``higher_is_better=False`` a perplexity or loss. Used to score each layer's candidates
        and to verify the chosen map end to end.
      sample_input: A realistic input (or tuple of inputs): layer shapes and timings use it.
      candidates: Policies to consider; float32 is always considered. Quantized ones only for
        layers with such a kernel.
      max_drop: How much worse than float32 the metric may get, in its direction: the allowed
        drop when ``higher_is_better``, the allowed rise otherwise. A fraction of the float32
        metric when ``relative`` (for a lower-is-better metric: at most ``(1 + max_drop)``
        times float32's value, which must be positive), else absolute.
      relative: See ``max_drop``.
      higher_is_better: The metric's direction: True for accuracy-like metrics, False for
        perplexity, loss or error rate (lower is better). Every figure derived from the metric
        (per-layer accuracy costs, the solver's budget, verification, decisions, the summary
        and the report) reads ``max_drop`` in this direction; costs are always >= 0 (a
        worsening).
      memory_budget: Optional cap on the bytes of the tuned layers' weights: a hard constraint
        of the solver, beside the accuracy budget (a configuration over it is never chosen,
        float32 included); it must be at least the bytes of every layer on its smallest
        candidate.
      cache_dir: Where measurements are cached; a rerun resumes from it.
      progress: Show a progress bar per phase.
      calibration_inputs: Batches (arrays or tuples) to calibrate float8 scales and to compare
        outputs with float32; defaults to ``[sample_input]``.
      test_fn: Optional ``test_fn(model) -> float`` on separate data, reported (never used to
        decide) for float32 and the chosen map.
      repeats: Timing repetitions per layer (end-to-end timings use twice as many).
      max_rounds: Verify/repair rounds.
      min_speedup: The margin: a configuration replaces float32 (or a simpler configuration)
        only when the lower bound of the confidence interval of its end-to-end speed-up, from
        paired interleaved rounds, is at least this (changes within timing noise are not made).
      profile_accuracy: How per-layer accuracy costs are obtained. Every mode first verifies
        the fastest assignment (every layer on its fastest policy, accuracy ignored) with one
        evaluation; if it meets the budget nothing faster exists and no cost is needed.
        Otherwise, ``"auto"`` estimates each layer's cost from its output error under each
        candidate (measured with its latency: no evaluation), scaled so that the fastest
        assignment's layers add up to its observed drop, then solves and verifies end to end
        (repairing the estimates by what it observes); only if no map within budget is found
        that way are costs measured one layer at a time. ``"measure"`` measures them one layer
        at a time (the rest float32, scored with ``eval_fn``) as soon as the fastest assignment
        breaks the budget. ``"always"`` measures every candidate of every layer, whatever its
        speed, before solving (a complete sensitivity table for the report). ``"first_order"``
        estimates every cost from ``loss_fn``'s gradient at each layer's output and the layer's
        output error under each candidate on the calibration batches
        (:mod:`autopolicy.search.first_order`: one backward pass per batch, no evaluation), then
        solves and verifies end to end (repairing the estimates by what it observes) and never
        measures a layer; ``"auto"`` does the same when ``loss_fn`` is given and the adapter can
        take gradients (an ``autopolicy.nn`` model), falling back to measuring if no map within
        budget is found.
      confirm_seconds: Time allowed for extra paired rounds when a speed-up's interval
        straddles the margin; after it, the simpler configuration wins.
      shared_cache_dir: A directory shared by runs on this machine (the command line's
        ``$AUTOPOLICY_CACHE/measurements``): layer and cast timings (keyed by the hardware
        fingerprint and the layer's signature) and end-to-end rounds and decisions (by the
        fingerprint and the model) found there are reused instead of measured, and new ones are
        added to it when the run ends; accuracy is never taken from it. None: only ``cache_dir``.
      adapter: A factory ``adapter(model, sample_args, calibration) -> ModelAdapter`` to use
        instead of the one registered for the model's type.
      loss_fn: ``loss_fn(model, *batch)``: a differentiable loss on a calibration batch, as
        per-example losses (an array whose mean is the loss, e.g. each next token's negative
        log-likelihood; a scalar counts the batch's leading dimension as its examples), for
        the first-order estimate (``profile_accuracy``). None: no such estimate.
      loss_link: How a change of the loss reads as a change of the metric: ``"exp"`` when the
        metric is ``exp`` of the mean loss (a perplexity), ``"loss"`` when it is the loss
        itself, ``"fitted"`` otherwise (one scale fitted so that the fastest map's changed layers
        add up to its observed drop).
      loss_inputs: The batches ``loss_fn`` is differentiated on (each a tuple of its arguments
        after the model, or one array): labels may be part of them. Default: the calibration
        batches.
      step_carry: For an objective that is one step of a loop with state (a decoder's step and
        its key/value cache): ``step_carry(sample_args, outputs)`` gives the next step's
        arguments (a tuple like ``sample_input``'s, with the same shapes and dtypes). End-to-end
        timings then run steps back to back, each from the state the last left, updated in
        place, as a decoding loop does; without it every timed step starts from the same
        inputs and copies the state it updates (on SmolLM2's 11.8 MB cache: 12.8 ms an int8 step
        against 11.4 steady). None: a stateless call.
      executor: Any ``concurrent.futures.Executor`` (a ``ProcessPoolExecutor``, Dask's
        ``Client.get_executor()``, :class:`autopolicy.distributed.RayExecutor`) to run the
        one-layer accuracy evaluations on; latency is always measured here, and the chosen map
        is verified here. The model, ``eval_fn`` and calibration data travel to the workers
        with cloudpickle (:mod:`autopolicy.search.executor`). None: every evaluation here.
      workload: The timed objective as several calls (:class:`autopolicy.search.Phase`, e.g. a
        prefill of 512 tokens once, then 128 decode steps: see
        :func:`autopolicy.nn.generation.workload_phases`): every layer is timed in each phase
        and the solver, the kernels and the end-to-end decisions minimise the weighted sum of
        the phases' seconds; each configuration's phases are reported
        (``Configuration.phase_latency_s``). ``sample_input`` and ``step_carry`` then serve
        accuracy (calibration's default batch, layer fidelity) only. None: ``sample_input``'s
        call is the objective.

    With several JAX processes (``jax.distributed``, a model sharded over a mesh that spans
    them), call ``tune`` on every process with the same arguments: each timing sample is the
    slowest process's (gathered), ``eval_fn`` must return the same value on every process
    (checked), the chosen map is checked to be the same on each, and only process 0 reads and
    writes ``cache_dir`` (the others start from its entries, broadcast) and saves the result.

    Returns:
      A :class:`TuneResult`. The map is never slower end to end than the best uniform policy
      that meets the budget: those are verified too and the fastest verified choice wins.

    Raises:
      ValueError: for an unknown candidate, a negative budget, an unbuilt or quantized model, a
        model without tunable layers, a float32 model that fails to build or run, an ``eval_fn``
        that raises or returns a non-finite value on it (a relative budget of a lower-is-better
        metric also needs it positive), a ``memory_budget`` no assignment meets (naming the
        least bytes achievable),
        or when no configuration meets both budgets; with several processes, for an ``eval_fn``
        whose values differ between them, or an ``executor``. Other configurations that fail to build,
        run or be scored are excluded (the reason in their ``excluded`` field), not fatal.
      TypeError: for an ``eval_fn`` (or ``test_fn``) that returns something other than a real
        number (``"0.9"``), naming it.
      RuntimeError: with several processes, if they chose different maps (a bug, or processes
        given different inputs).
    """
    start = time.perf_counter()
    with Costs() as costs, phase("checks"):  # what follows, less the phases marked inside
        candidate_policies = _checks.check_arguments(candidates, max_drop, memory_budget, repeats, max_rounds)
        _checks.check_budget(max_drop, relative, higher_is_better)
        higher_is_better = bool(higher_is_better)
        _checks.check_decision(min_speedup, confirm_seconds)
        if executor is not None and not callable(getattr(executor, "submit", None)):
            raise TypeError(f"executor must be a concurrent.futures.Executor (an object with submit(fn, *args) "
                            f"returning a future), or None. Received: executor={executor!r}")
        if executor is not None and _multihost.count() > 1:
            raise ValueError(f"executor cannot be used with several JAX processes (jax.process_count()="
                             f"{_multihost.count()}): a worker cannot join the processes' programs. Pass "
                             "executor=None; every process then scores its share of the same programs.")
        args = _checks.check_sample_input(sample_input)
        if step_carry is not None and not callable(step_carry):
            raise TypeError(f"step_carry must be callable (step_carry(sample_args, outputs) -> next args) or None. "
                            f"Received: step_carry={step_carry!r}")
        phases = None if workload is None else workload_mod.check_phases(workload)
        if profile_accuracy not in PROFILE_ACCURACY:
            raise ValueError(f"profile_accuracy must be one of {list(PROFILE_ACCURACY)}. "
                             f"Received: profile_accuracy={profile_accuracy!r}")
        first_order.check_arguments(profile_accuracy, loss_fn, loss_link, higher_is_better)
        calibration = _batches(calibration_inputs, args)
        loss_batches = calibration if loss_inputs is None else _batches(loss_inputs, args)
        made = get_adapter(model, args, calibration, adapter)
        first_order.check_arguments(profile_accuracy, loss_fn, loss_link, higher_is_better, made)
        layer_sites = profiling.sites(made.layers(), candidate_policies)
        if not layer_sites:
            raise ValueError("The model has no tunable layers (Dense, EinsumDense, Conv2D, Embedding, ...).")
        detected = hardware.detect()
        # Process 0's: every process must find the same measurements in the cache.
        fingerprint = _multihost.from_leader(hardware.fingerprint(detected))
        # The cache (its directory checked and locked) before any evaluation or measurement.
        with MeasurementCache(cache_dir, _shared_file(shared_cache_dir)) as cache:
            reference_model, scorer = _reference(made, eval_fn, calibration)
            timed = [(None, made, args, step_carry, 1.0)]  # (phase, adapter, args, carry, weight)
            if phases is not None:
                timed = [_phase_run(model, p, calibration, adapter) for p in phases]
            for name, phase_adapter, _, carry, _ in timed:
                if carry is None:
                    continue
                # Traced only: a carry that breaks the loop fails here, not minutes later.
                program = phase_adapter.model_program(reference_model)
                try:
                    timing.check_carry(timing.Candidate(program.fn, program.args, program.state, carry=carry))
                except Exception as e:  # pylint: disable=broad-except
                    where = "step_carry(sample_args, outputs)" if name is None else f"phase {name!r}'s step_carry"
                    raise ValueError(f"{where} failed: {type(e).__name__}: {e}") from e
            baseline = _baseline_metric(eval_fn, reference_model)
            weights_digest = made.weights_digest()
            allowed = _checks.allowed_worsening(baseline, max_drop, relative, higher_is_better)
            ctx = Context(
                adapter=made, scorer=scorer, cache=cache,
                fingerprint=fingerprint,
                digest=key(weights_digest, digest_arrays(calibration),
                           getattr(eval_fn, "__qualname__", repr(eval_fn))),
                budget=Budget(baseline, allowed, memory_budget, higher_is_better, float(max_drop), bool(relative)),
                candidates=tuple(candidate_policies), sample_args=args,
                repeats=repeats, max_rounds=max_rounds, min_speedup=min_speedup, confirm_seconds=confirm_seconds,
                progress=progress,
                reference_model=reference_model, executor=executor)
            if phases is None:
                latency = profiling.measure_latency(made, layer_sites, cache, fingerprint, repeats, progress)
            else:
                latency = workload_mod.combine_profiles(
                    [profiling.measure_latency(a, profiling.sites(a.layers(), candidate_policies), cache, fingerprint,
                                               repeats, progress) for _, a, _, _, _ in timed],
                    [w for *_, w in timed])
            _check_memory(latency, memory_budget)
            kernels = profiling.kernel_choice(latency)
            if supports_kernels(made):  # every model built from here on runs the fastest kernels
                made.use_kernels(kernels)
            if executor is not None:  # what the workers need to score as the target would
                ctx = dataclasses.replace(ctx, workload=executor_mod.Workload(
                    model, eval_fn, args, ctx.scorer.calibration, adapter,
                    kernels if supports_kernels(made) else None))
            models: verify.Models = {}
            with phase("calibration"):
                uniform_configs = verify.uniforms(ctx, latency, models)
                # Steady-state steps time differently: their rounds and decisions are their own.
                # Each configuration's kernels are part of its identity in the rounds (key_of):
                # a later run whose profile chose another kernel for some layer re-times only the
                # configurations that run it.
                ends = [EndToEnd(a, models, cache, fingerprint,
                                 ctx.digest if carry is None else key(ctx.digest, "steps"),
                                 [_input_shape(x) for x in phase_args], carry,
                                 kernels if supports_kernels(made) else None)
                        for _, a, phase_args, carry, _ in timed]
                e2e = ends[0] if phases is None else workload_mod.PhasedEndToEnd(
                    ends, [n for n, *_ in timed], [w for *_, w in timed])
                # Half the repeats: enough medians for the latency model; decisions pair these
                # rounds with the final ones (verify.choose).
                e2e.time_group(uniform_configs, max(repeats // 2, 3), "calibration")
                calibration = latency_model.fit(latency, [(u.assignment, e2e.summary(u).median)
                                                          for u in uniform_configs if e2e.samples(u)])
            with phase("verify"):
                tried, settled = ([], False) if profile_accuracy == "always" else verify.fastest_first(
                    ctx, latency, models, calibration)
            accuracy = accuracy_phase.skipped_accuracy(ctx, latency) if settled else None
            gradients = loss_fn is not None and supports_first_order(made)
            if not settled and (profile_accuracy == "first_order" or (profile_accuracy == "auto" and (tried or gradients))):
                with phase("sensitivity"):
                    accuracy = (first_order.estimate(ctx, latency, loss_fn, loss_link, loss_batches,
                                                     tried[0] if tried else None)
                                if gradients else accuracy_phase.estimate_accuracy(ctx, latency, tried[0]))
                    if accuracy is not None and accuracy.method == "first_order":
                        # Each candidate's estimates add up to what its uniform policy measures.
                        uniform_configs = verify.score_uniforms(ctx, accuracy, uniform_configs, models)
                        accuracy = first_order.calibrate(
                            accuracy, loss_link, ctx.budget.baseline_metric,
                            {u.uniform: ctx.budget.drop(u.metric) for u in uniform_configs[1:] if u.metric is not None})
                if accuracy is not None:
                    with phase("verify"):
                        tried += verify.solve_and_verify(ctx, latency, accuracy, models, tried, calibration,
                                                         uniform_configs)
                    if not any(t.meets_budget for t in tried) and profile_accuracy == "auto":
                        accuracy = None  # the estimates misled: measure one layer at a time
            if accuracy is None:
                with phase("sensitivity"):
                    accuracy = accuracy_phase.measure_accuracy(ctx, latency,
                                                               every_candidate=profile_accuracy == "always")
                with phase("verify"):
                    tried += verify.solve_and_verify(ctx, latency, accuracy, models, tried, calibration,
                                                     uniform_configs)
            with phase("end-to-end rounds"):
                winner, entries, report_only, decisions = verify.choose(ctx, latency, tried, uniform_configs,
                                                                        models, e2e)
                if supports_kernels(made):  # layers timed alone may mislead: their kernels, end to end
                    winner, confirmed = verify.confirm_kernels(ctx, latency, winner, uniform_configs[0], models,
                                                               e2e, kernels)
                    entries = [winner if e.name == winner.name else e for e in entries]
                    decisions = [*decisions, *confirmed]
            # The latency model, refitted on every configuration timed, predicts each of them.
            final = latency_model.fit(latency, [(e.assignment, e.measured_latency_s) for e in entries
                                                if e.measured_latency_s is not None])
            entries = [e.with_(calibrated_latency_s=final.predict(latency, e.assignment)) for e in entries]
            winner = next(e for e in entries if e.name == winner.name)
            total = ctx.scorer.evaluations + accuracy.remote
            evaluations = {"profile": accuracy.evaluations, "verify": total - accuracy.evaluations - report_only,
                           "report_only": report_only, "total": total, "on_workers": accuracy.remote}
            with phase("verify"):
                test = _test_metrics(test_fn, reference_model, models[winner.name])
            _multihost.check_same([policies.serialize(winner.policy_map), winner.name, list(decisions)],
                                  "the chosen map and the decisions")
            return TuneResult(
                policy_map=winner.policy_map, model=models[winner.name], latency=latency, accuracy=accuracy,
                configurations=tuple(entries), chosen=winner, budget=ctx.budget, hardware=detected,
                fingerprint=fingerprint, candidates=tuple(p.name for p in candidate_policies), evaluations=evaluations,
                cache_stats={"hits": cache.hits, "misses": cache.misses, "shared_hits": cache.shared_hits},
                wall_time_s=time.perf_counter() - start,
                test=test, decisions=tuple(decisions), calibration=final,
                noise=noise.assess(latency, e2e), costs=costs.as_dict(), weights_digest=weights_digest,
                sample_args=args, structure=made.float_structure() if hasattr(made, "float_structure") else None,
                workload=None if phases is None else tuple(
                    {"phase": n, "weight": w, "inputs": [_input_shape(x) for x in a]} for n, _, a, _, w in timed))
