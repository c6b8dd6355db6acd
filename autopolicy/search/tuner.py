"""``tune``: measure every layer under every candidate policy on this machine, solve for the
fastest per-layer assignment within an accuracy budget, verify it end to end, emit the map."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, Sequence

from autopolicy import policies
from autopolicy.nn.protocol import NNModel
from autopolicy.search import _checks, hardware, profiling, solver, verify
from autopolicy.search._progress import progress
from autopolicy.search.cache import MeasurementCache, key, weights_digest
from autopolicy.search.result import TuneResult
from autopolicy.search.sensitivity import Scorer, check_metric

__all__ = ["tune", "DEFAULT_CANDIDATES"]

DEFAULT_CANDIDATES = (
    "float32",
    "mixed_bfloat16",
    "mixed_float16",
    "int8_from_float32",
    "float8_from_float32",
)
FLOAT32 = "float32"
PROFILE_ACCURACY = ("auto", "always")
SKIPPED = "not needed: the fastest assignment met the budget"


class _Run:
    """The state of one tuning run, phase by phase."""

    def __init__(self, model, eval_fn, args, candidates, budget_spec, memory_budget, cache_dir,
                 progress, calibration, repeats, max_rounds, min_speedup=1.0):
        self.start = time.perf_counter()
        self.adapter = NNModel(model)
        self.base = self.adapter.model
        self.eval_fn = eval_fn
        self.args = args
        self.candidates = candidates
        self.memory_budget = memory_budget
        self.progress = progress
        self.repeats = repeats
        self.max_rounds = max_rounds
        self.min_speedup = min_speedup
        tunable = self.adapter.tunable_layers()
        if not tunable:
            raise ValueError("The model has no tunable layers (Dense, EinsumDense, Conv2D, Embedding, ...).")
        try:
            self.calls = self.adapter.record_calls(*args)
        except Exception as e:  # pylint: disable=broad-except
            raise ValueError(f"The model failed on sample_input: {type(e).__name__}: {e}") from e
        self.sites = profiling.sites(tunable, self.calls, candidates)
        self.calibration = [args] if calibration is None else [b if isinstance(b, tuple) else (b,) for b in calibration]
        self.baseline = self._baseline_metric()
        max_drop, relative = budget_spec
        self.budget = max_drop * abs(self.baseline) if relative else float(max_drop)
        self.hardware = hardware.detect()
        self.fingerprint = hardware.fingerprint(self.hardware)
        self.cache = MeasurementCache(cache_dir)
        self.scorer = Scorer(eval_fn, self.calibration, self.base)
        self.digest = key(weights_digest(self.base), weights_digest(self.calibration),
                          getattr(eval_fn, "__qualname__", repr(eval_fn)))
        self.latency: dict[str, dict[str, dict]] = {}
        self.accuracy: dict[str, dict[str, dict]] = {}
        self.casts: dict = {}
        self.report_evaluations = 0  # uniform policies scored only to report the best one

    def _baseline_metric(self) -> float:
        try:
            value = self.eval_fn(self.base)
        except Exception as e:  # pylint: disable=broad-except
            raise ValueError(f"eval_fn raised on the float32 model: {type(e).__name__}: {e}") from e
        metric = check_metric(value, "the float32 model")
        if not math.isfinite(metric):
            raise ValueError(f"eval_fn returned {metric!r} for the float32 model; it must be finite.")
        return metric

    # --- phase 1: latency ---------------------------------------------------------------------

    def variant(self, policy_map: policies.DTypePolicyMap) -> Any:
        model = self.adapter.with_policies(policy_map)
        if any(p.quantization_mode == "float8" for p in policy_map.values()) or (
            policy_map.default_policy.quantization_mode == "float8"
        ):
            model = self.adapter.calibrate(model, self.calibration)
        return model

    def measure_latency(self) -> None:
        for site in progress(self.progress, self.sites, "latency", len(self.sites)):
            variants = {p.name: self.adapter.layer_with_policy(site.path, p) for p in site.candidates}
            self.latency[site.path] = profiling.layer_latency(
                site, variants, self.cache, self.fingerprint, self.repeats
            )
            self.cache.flush()
        needed = []
        for i, site in enumerate(self.sites):
            own = {p.compute_dtype for p in site.candidates}
            before = {p.compute_dtype for p in self.sites[i - 1].candidates} if site.chained else {FLOAT32}
            needed += [(site.input_shape, a, b) for a in before for b in own if a != b]
        self.casts = profiling.cast_latency(needed, self.cache, self.fingerprint, self.repeats)
        self.cache.flush()

    def _site_casts(self, site: profiling.LayerSite) -> dict:
        return {(a, b): s for (shape, a, b), s in self.casts.items() if shape == site.input_shape}

    def _dominated(self, i: int, policy: policies.DTypePolicy) -> bool:
        """Slower than float32 by more than any cast it could save: never chosen."""
        site, table = self.sites[i], self.latency[self.sites[i].path]
        casts = self._site_casts(site)
        slack = max([s for (a, b), s in casts.items() if b == FLOAT32] + [0.0])
        if i + 1 < len(self.sites) and self.sites[i + 1].chained:
            following = self._site_casts(self.sites[i + 1])
            slack += max([s for (a, b), s in following.items() if a == FLOAT32] + [0.0])
        return table[policy.name]["latency_s"] - table[FLOAT32]["latency_s"] > slack

    # --- phase 2: accuracy ---------------------------------------------------------------------

    def _accuracy_table(self, path: str) -> dict:
        """The layer's accuracy table, created with its float32 reference row."""
        return self.accuracy.setdefault(path, {FLOAT32: {"metric": self.baseline, "cost": 0.0, "sqnr_db": math.inf,
                                                         "kl": 0.0, "finite": True, "status": "reference"}})

    def skip_accuracy(self, reason: str) -> None:
        """Records why no layer's accuracy cost was measured (the verified map made it moot)."""
        for site in self.sites:
            table = self._accuracy_table(site.path)
            for policy in site.candidates[1:]:
                finite = self.latency[site.path][policy.name]["finite"]
                table[policy.name] = {"status": reason if finite else "disqualified: non-finite layer output"}

    def measure_accuracy(self) -> None:
        todo = [(i, s, p) for i, s in enumerate(self.sites) for p in s.candidates[1:]]
        for i, site, policy in progress(self.progress, todo, "sensitivity", len(todo)):
            record = self.latency[site.path][policy.name]
            table = self._accuracy_table(site.path)
            if not record["finite"]:
                table[policy.name] = {"status": "disqualified: non-finite layer output"}
                continue
            if self._dominated(i, policy):
                table[policy.name] = {"status": "skipped: slower than float32"}
                continue
            cache_key = key(self.fingerprint, "accuracy", self.digest, site.path, policy.name)

            def measure(site=site, policy=policy):
                variant = self.variant(policies.DTypePolicyMap(FLOAT32, {site.path: policy}))
                return self.scorer.score(variant, f"{site.path} as {policy.name}")

            scored = dict(self.cache.get_or_measure(cache_key, measure))
            self.cache.flush()
            if not scored["finite"]:
                scored["status"] = "disqualified: non-finite model output or metric"
            else:
                scored["status"] = "measured"
                scored["cost"] = max(0.0, self.baseline - scored["metric"])
            table[policy.name] = scored

    # --- phase 3: solve -------------------------------------------------------------------------

    def problem(self, inflate: dict | None = None, latency_only: bool = False) -> list[solver.Layer]:
        """The solver's layers: measured options with their (inflated) accuracy costs, or with
        ``latency_only`` every option whose layer output stayed finite, at no accuracy cost."""
        inflate = inflate or {}
        layers = []
        for site in self.sites:
            options = []
            for policy in site.candidates:
                acc = self.accuracy.get(site.path, {}).get(policy.name, {})
                lat = self.latency[site.path][policy.name]
                if latency_only:
                    if policy.name != FLOAT32 and not lat["finite"]:
                        continue
                    acc = {}
                elif policy.name != FLOAT32 and acc.get("status") != "measured":
                    continue
                cost = acc.get("cost", 0.0)
                cost = cost * inflate.get((site.path, policy.name), (1.0, 0.0))[0] + inflate.get(
                    (site.path, policy.name), (1.0, 0.0))[1]
                options.append(solver.Option(policy.name, policy.compute_dtype, lat["latency_s"], cost,
                                             float(lat["nbytes"])))
            layers.append(solver.Layer(site.path, tuple(options), site.chained, self._site_casts(site)))
        return layers

    def predicted_latency(self, assignment: dict[str, str]) -> float:
        """Summed layer latencies and casts for any assignment (unmeasured policies included)."""
        total, previous = 0.0, FLOAT32
        for site in self.sites:
            name = assignment.get(site.path, FLOAT32)
            dtype = policies.get(name).compute_dtype
            source = previous if site.chained else FLOAT32
            total += self.latency[site.path][name]["latency_s"]
            total += 0.0 if source == dtype else self._site_casts(site).get((source, dtype), 0.0)
            previous = dtype
        return total

    def policy_map(self, assignment: dict[str, str]) -> policies.DTypePolicyMap:
        """The map of an assignment; parameter-free layers that consume a retyped layer's output
        follow its compute dtype (so no cast is inserted between them)."""
        entries: dict[str, Any] = {p: policies.get(n) for p, n in assignment.items() if n != FLOAT32}
        tunable = {s.path for s in self.sites}
        for path, call in self.calls.items():
            if path in tunable or call.producer not in entries:
                continue
            producer = entries[call.producer]
            entries[path] = policies.DTypePolicy(getattr(producer, "source_name", producer.name))
        return policies.DTypePolicyMap(FLOAT32, entries)


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
) -> TuneResult:
    """Finds the fastest per-layer policies on this machine whose metric stays within budget.

    Args:
      model: A built float ``autopolicy.nn`` model.
      eval_fn: ``eval_fn(model) -> float``, higher is better (accuracy on held-out data). Used
        to score each layer's candidates and to verify the chosen map end to end.
      sample_input: A realistic input (or tuple of inputs): layer shapes and timings use it.
      candidates: Policies to consider; float32 is always considered. Quantized ones only for
        layers with such a kernel.
      max_drop: The allowed metric drop: a fraction of the float32 metric when ``relative``,
        else absolute.
      relative: See ``max_drop``.
      memory_budget: Optional cap on the bytes of the tuned layers' weights.
      cache_dir: Where measurements are cached; a rerun resumes from it.
      progress: Show a progress bar per phase.
      calibration_inputs: Batches (arrays or tuples) to calibrate float8 scales and to compare
        outputs with float32; defaults to ``[sample_input]``.
      test_fn: Optional ``test_fn(model) -> float`` on separate data, reported (never used to
        decide) for float32 and the chosen map.
      repeats: Timing repetitions per layer (end-to-end timings use twice as many).
      max_rounds: Verify/repair rounds.
      min_speedup: The chosen configuration must be at least this much faster than float32 end to
        end, or float32 is kept (changes within timing noise are not worth their risk).
      profile_accuracy: ``"auto"`` first verifies the fastest assignment (every layer on its
        fastest policy, accuracy ignored) with one evaluation and measures each layer's accuracy
        cost only if that breaks the budget: the fastest assignment that meets the budget is
        already optimal. ``"always"`` measures every layer's cost (a complete sensitivity table
        for the report) before solving.

    Returns:
      A :class:`TuneResult`. The map is never slower end to end than the best uniform policy
      that meets the budget: those are verified too and the fastest verified choice wins.

    Raises:
      ValueError: for an unknown candidate, a negative budget, an unbuilt or quantized model, a
        model without tunable layers, or an ``eval_fn`` that raises or returns a non-finite value.
    """
    candidate_policies = _checks.check_arguments(candidates, max_drop, memory_budget, repeats, max_rounds)
    args = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    if isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)) or not min_speedup >= 1:
        raise ValueError(f"min_speedup must be a number >= 1. Received: min_speedup={min_speedup!r}")
    if profile_accuracy not in PROFILE_ACCURACY:
        raise ValueError(f"profile_accuracy must be one of {list(PROFILE_ACCURACY)}. "
                         f"Received: profile_accuracy={profile_accuracy!r}")
    run = _Run(model, eval_fn, args, candidate_policies, (max_drop, relative), memory_budget, cache_dir,
               progress, calibration_inputs, repeats, max_rounds, min_speedup)
    run.measure_latency()
    tried: list[dict] = []
    settled = False
    if profile_accuracy == "auto":
        tried, settled = verify.fastest_first(run)
    before = run.scorer.evaluations
    if settled:
        run.skip_accuracy(SKIPPED)
    else:
        run.measure_accuracy()
    profile_evaluations = run.scorer.evaluations - before
    if not settled:
        tried += verify.solve_and_verify(run, tried)
    winner, entries = verify.choose(run, tried)
    from autopolicy.search import _report_tables  # pylint: disable=import-outside-toplevel

    summary = _report_tables.summary(run, winner, entries, profile_evaluations, test_fn)
    return TuneResult(
        policy_map=winner["policy_map"],
        model=winner["model"],
        profile=_report_tables.profile_frame(run, winner),
        frontier=_report_tables.frontier_frame(run),
        summary=summary,
    )
