"""The typed results of the search's phases.

latency profile -> accuracy profile -> problem -> verified configurations -> result. Each is a
frozen dataclass made by a pure function of the ones before it (plus measurements); the result,
the saved files and the report read only these.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from autopolicy import policies
from autopolicy.search import solver
from autopolicy.search._defaults import REFERENCE, change_word, within_budget, worsening
from autopolicy.search.adapter import TunableLayer

__all__ = [
    "Site",
    "failed",
    "LayerTiming",
    "LatencyProfile",
    "LayerAccuracy",
    "AccuracyProfile",
    "Budget",
    "Problem",
    "Configuration",
    "Status",
]


class Status:
    """Why a layer's accuracy figure under a policy is what it is (the ``status`` column)."""

    REFERENCE = "reference"
    MEASURED = "measured"
    SLOWER = "skipped: slower than float32"
    NOT_NEEDED = "not needed: the fastest assignment met the budget"
    NONFINITE_LAYER = "disqualified: non-finite layer output"
    NONFINITE_MODEL = "disqualified: non-finite model output or metric"
    FAILED = "disqualified: failed to build or run"  # followed by the error: "(TypeError: ...)"
    ESTIMATED = "estimated: layer output error, scaled to the observed drop"
    NOT_ESTIMATED = "not estimated: the layer output error is unknown"
    FIRST_ORDER = "estimated: loss gradient x layer output error (first order)"


@dataclasses.dataclass(frozen=True)
class Site:
    """A tunable layer where it sits in the chain the solver walks, with its candidates.

    ``chained``: its first input is the previous tunable layer's output, so a change of compute
    dtype between them costs a cast (otherwise its input comes from the model in float32).
    """

    index: int
    layer: TunableLayer
    chained: bool
    candidates: tuple[policies.DTypePolicy, ...]

    @property
    def path(self) -> str:
        return self.layer.path

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.layer.input_shape


@dataclasses.dataclass(frozen=True)
class LayerTiming:
    """One layer under one policy, timed alone at its real input."""

    latency_s: float
    latency_p25_s: float
    latency_p75_s: float
    latency_cv: float
    repeats: int
    inner: int  # calls per timed call
    finite: bool  # its output on the real input is free of inf/NaN
    nbytes: int
    kernel: str = ""  # the kernel (tactic) it runs, where its mode names one
    output_error: float = math.nan  # relative squared error of its output vs float32 on the real input
    tactics: tuple[tuple[str, float], ...] = ()  # (kernel, median seconds) of every kernel timed
    collectives: str = ""  # a layer over several devices: the collectives it compiles to ("none")

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "LayerTiming":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in fields})


@dataclasses.dataclass(frozen=True)
class LatencyProfile:
    """Phase 1: every site's latency under each candidate, and the casts between dtypes."""

    sites: tuple[Site, ...]
    timings: Mapping[str, Mapping[str, LayerTiming]]  # path -> policy name -> timing
    casts: Mapping[tuple[tuple[int, ...], str, str], float]  # (shape, from, to) -> seconds
    # Bytes per second at which the device streams weights too large for its caches
    # (profiling.stream_bandwidth); None where the model's weights fit in the last-level cache.
    bandwidth: float | None = None

    def timing(self, path: str, policy: str) -> LayerTiming:
        return self.timings[path][policy]

    def latency_s(self, site: Site, policy: str) -> float:
        """The layer's seconds in the model: its time alone, but no less than its weight bytes
        over :attr:`bandwidth`. A layer timed alone re-reads weights its last call left in the
        caches; in a model whose weights exceed them (a decoder at batch 1) every call streams
        its weights from memory, and a small float32 layer timed alone looks up to 2x faster
        than it runs there. Embeddings (``gather``) read only the rows they look up."""
        t = self.timings[site.path][policy]
        if self.bandwidth is None or site.layer.gather:
            return t.latency_s
        return max(t.latency_s, t.nbytes / self.bandwidth)

    def site_casts(self, site: Site) -> dict[tuple[str, str], float]:
        return {(a, b): s for (shape, a, b), s in self.casts.items() if shape == site.input_shape}

    def predicted_latency(self, assignment: Mapping[str, str]) -> float:
        """Summed layer latencies (:meth:`latency_s`) and casts for an assignment (missing layers: float32)."""
        total, previous = 0.0, REFERENCE
        for site in self.sites:
            name = assignment.get(site.path, REFERENCE)
            dtype = policies.get(name).compute_dtype
            source = previous if site.chained else REFERENCE
            total += self.latency_s(site, name)
            total += 0.0 if source == dtype else self.site_casts(site).get((source, dtype), 0.0)
            previous = dtype
        return total

    def nbytes(self, assignment: Mapping[str, str]) -> int:
        return sum(self.timings[s.path][assignment.get(s.path, REFERENCE)].nbytes for s in self.sites)

    def least_nbytes(self) -> int:
        """The fewest weight bytes any assignment of the candidates takes (each layer on its smallest)."""
        return sum(min(self.timings[s.path][p.name].nbytes for p in s.candidates) for s in self.sites)


@dataclasses.dataclass(frozen=True)
class LayerAccuracy:
    """One layer under one policy (the rest float32), scored end to end."""

    status: str
    metric: float = math.nan
    cost: float = math.nan  # how much worse than float32 the metric is, in its direction (drop or rise), >= 0
    sqnr_db: float = math.nan
    kl: float = math.nan
    proxy: str = ""  # scored by a worker whose numerics differ from the target's: how they differ

    @property
    def usable(self) -> bool:
        return self.status in (Status.REFERENCE, Status.MEASURED, Status.ESTIMATED, Status.FIRST_ORDER)


@dataclasses.dataclass(frozen=True)
class AccuracyProfile:
    """Phase 2: per-layer accuracy costs (or why they were not measured)."""

    entries: Mapping[str, Mapping[str, LayerAccuracy]]  # path -> policy name -> accuracy
    method: str  # "measured" (one layer at a time, end to end), "estimated", "first_order" or "skipped"
    evaluations: int
    scale: float | None = None  # estimated: metric drop (or rise) per unit of relative output error
    remote: int = 0  # of ``evaluations``, those made by an executor's workers
    # first_order: each candidate's scale fitted on its uniform policy's measured change
    # (first_order.calibrate), by policy name; None when none was fitted.
    scales: Mapping[str, float] | None = None

    @property
    def measured(self) -> bool:
        """Whether there are per-layer costs (measured or estimated) to solve with."""
        return self.method != "skipped"

    def get(self, path: str, policy: str) -> LayerAccuracy | None:
        return self.entries.get(path, {}).get(policy)


@dataclasses.dataclass(frozen=True)
class Budget:
    """The accuracy budget: the float32 metric, its direction, and how much worse it may get.

    ``allowed_drop`` is read in the metric's direction: the drop allowed below float32's metric
    when ``higher_is_better`` (accuracy), the rise allowed above it otherwise (perplexity, loss).
    ``memory_budget`` caps the tuned layers' weight bytes (None: no cap).

    >>> b = Budget(20.0, 0.4, higher_is_better=False)
    >>> b.limit_metric, b.meets(20.3), b.meets(20.5), b.drop(19.0), b.metric_after(0.1)
    (20.4, True, False, -1.0, 20.1)
    """

    baseline_metric: float
    allowed_drop: float
    memory_budget: float | None = None
    higher_is_better: bool = True
    max_drop: float | None = None  # as given to tune (a fraction when ``relative``), for reports
    relative: bool | None = None

    @property
    def limit_metric(self) -> float:
        """The worst metric within budget: the least when higher is better, the most otherwise."""
        return self.metric_after(self.allowed_drop)

    @property
    def min_metric(self) -> float:
        """The least metric within budget (-inf when lower is better: there is no floor)."""
        return self.limit_metric if self.higher_is_better else -math.inf

    @property
    def word(self) -> str:
        """"drop" or "rise": what a worsening of this metric is called."""
        return change_word(self.higher_is_better)

    def drop(self, metric: float) -> float:
        """How much worse than float32 ``metric`` is, in the metric's direction (< 0: better)."""
        return worsening(self.baseline_metric, metric, self.higher_is_better)

    def metric_after(self, cost: float) -> float:
        """The metric that an accuracy cost of ``cost`` (a worsening) leads to."""
        return self.baseline_metric - cost if self.higher_is_better else self.baseline_metric + cost

    def goodness(self, metric: float) -> float:
        """``metric`` oriented so that larger is better (for sorting and frontiers)."""
        return metric if self.higher_is_better else -metric

    def meets(self, metric: float | None) -> bool:
        return within_budget(self.baseline_metric, metric, self.allowed_drop, self.higher_is_better)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Phase 3: what the solver is handed."""

    layers: tuple[solver.Layer, ...]
    budget: float  # summed accuracy cost allowed (inf: latency only)
    memory_budget: float | None


def failed(step: str, error: Exception) -> str:
    """Why a configuration is excluded after ``error`` in ``step``: ``failed to <step>: <type>: <message>``.

    >>> failed("build", ValueError("no kernel"))
    'failed to build: ValueError: no kernel'
    """
    return f"failed to {step}: {type(error).__name__}: {str(error)[:200]}"


@dataclasses.dataclass(frozen=True)
class Configuration:
    """Phase 4: a whole-model configuration, scored and timed end to end.

    ``kind`` is ``"map"`` (solved, verified in round ``round``) or ``"uniform"`` (every layer on
    ``uniform``, float32 where a layer has no such kernel).
    """

    name: str
    kind: str
    assignment: Mapping[str, str]  # path -> policy name, every tunable layer
    policy_map: policies.DTypePolicyMap
    predicted_latency_s: float
    round: int | None = None
    uniform: str | None = None
    predicted_accuracy_cost: float | None = None  # None: costs ignored (fastest first) or unknown
    exact: bool | None = None
    metric: float | None = None
    measured_latency_s: float | None = None
    measured_latency_cv: float | None = None
    meets_budget: bool | None = None
    disqualified: tuple[str, ...] = ()  # layers whose output is not finite under it
    excluded: str = ""  # why it cannot be chosen (over the memory budget, failed to build or run)
    nbytes: int | None = None  # the tuned layers' weight bytes
    calibrated_latency_s: float | None = None  # predicted by the latency model fitted end to end
    speedup: float | None = None  # vs float32, median of paired rounds
    speedup_low: float | None = None  # its confidence interval
    speedup_high: float | None = None
    rounds: int = 0  # end-to-end rounds it was timed in
    # (path, kernel) of the layers whose kernel the end-to-end rounds chose over the one timed
    # fastest alone (verify.confirm_kernels); empty: every layer runs the profile's kernel.
    kernels: tuple[tuple[str, str], ...] = ()
    # A workload's phases (search.workload): (phase, median seconds per call) end to end; the
    # measured latency is their weighted sum. Empty: one timed call.
    phase_latency_s: tuple[tuple[str, float], ...] = ()

    @property
    def changed(self) -> dict[str, str]:
        return {p: n for p, n in self.assignment.items() if n != REFERENCE}

    def with_(self, **changes: Any) -> "Configuration":
        return dataclasses.replace(self, **changes)
