"""The outcome of a tuning run and the run directory it writes."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

from autopolicy import _atomic, _multihost, policies

__all__ = ["TuneResult", "write_run", "PROFILE_FILE", "FRONTIER_FILE", "MAP_FILE", "SUMMARY_FILE", "load_run",
           "write_summary"]

PROFILE_FILE = "profile.csv"
FRONTIER_FILE = "frontier.csv"
MAP_FILE = "policy_map.json"
SUMMARY_FILE = "summary.json"


def _json_safe(value: Any) -> Any:
    """NaN/inf become None so the summary is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


@dataclasses.dataclass
class TuneResult:
    """What :func:`autopolicy.search.tune` found, phase by phase.

    Attributes:
      policy_map: The chosen per-layer policies (a ``DTypePolicyMap`` keyed by layer path).
      model: The model with the map applied (float8 scales calibrated), of the user's kind.
      latency: Phase 1, every layer's latency under every candidate (``LatencyProfile``).
      accuracy: Phase 2, every layer's accuracy cost, or why none was measured.
      configurations: Phase 4, every configuration verified or timed end to end (the solved
        maps, then the uniform policies).
      chosen: The winning configuration.
      budget: The float32 metric, its direction and the allowed drop (a rise when lower is better).
      hardware, fingerprint: The machine the figures were measured on.
      candidates: The candidate policy names.
      evaluations: ``eval_fn`` calls by purpose (profile, verify, report_only, total).
      cache_stats: Measurement-cache hits and misses.
      wall_time_s: The run's wall time.
      test: ``test_fn`` of float32 and of the chosen model, when given.
      decisions: How the winner was decided: each challenge, its speed-up with a confidence
        interval and the rounds it took.
      calibration: The latency model's per-policy scales, fitted on the end-to-end timings.
      noise: What the run saw of the machine's load and the timings' spread, and a verdict.
      costs: The tuner's own cost: wall seconds per phase (``phases_s``, see
        :data:`autopolicy.search.costs.PHASES`) and XLA compilations (``compilations``, of which
        ``compile_cache_hits`` were loaded from the persistent compilation cache; ``compile_s``).

    ``profile``, ``frontier`` (DataFrames) and ``summary`` (a JSON-able dict) are derived from
    these; ``save`` writes them.
    """

    policy_map: policies.DTypePolicyMap
    model: Any
    latency: Any  # phases.LatencyProfile
    accuracy: Any  # phases.AccuracyProfile
    configurations: tuple
    chosen: Any  # phases.Configuration
    budget: Any  # phases.Budget
    hardware: dict[str, Any]
    fingerprint: str
    candidates: tuple[str, ...]
    evaluations: dict[str, int]
    cache_stats: dict[str, int]
    wall_time_s: float
    test: dict[str, float] | None = None
    decisions: tuple[str, ...] = ()
    calibration: Any = None  # latency_model.Calibration fitted on every end-to-end timing
    noise: dict[str, Any] | None = None
    costs: dict[str, Any] | None = None

    @functools.cached_property
    def profile(self) -> Any:
        """One row per layer and candidate policy: latency, accuracy cost, fidelity, bytes."""
        from autopolicy.search import _report_tables  # pylint: disable=import-outside-toplevel

        return _report_tables.profile_frame(self.latency, self.accuracy, self.chosen)

    @functools.cached_property
    def frontier(self) -> Any:
        """The predicted latency/accuracy-cost Pareto frontier of per-layer assignments."""
        from autopolicy.search import _report_tables  # pylint: disable=import-outside-toplevel

        return _report_tables.frontier_frame(self.latency, self.accuracy, self.budget, self.configurations)

    @functools.cached_property
    def summary(self) -> dict[str, Any]:
        """Hardware, budget, predicted and measured figures of the map and of each uniform
        policy, evaluation counts, wall time (what ``summary.json`` holds; add keys before
        ``save`` to record more)."""
        from autopolicy.search import _report_tables  # pylint: disable=import-outside-toplevel

        return _report_tables.summary(self)

    def save(self, run_dir: str | os.PathLike) -> None:
        """Writes ``profile.csv``, ``frontier.csv``, ``policy_map.json`` (Keras envelope) and
        ``summary.json`` into ``run_dir``, each atomically. With several JAX processes only
        process 0 writes (every process holds the same result; the others write nothing)."""
        write_run(run_dir, self.policy_map, self.profile, self.frontier, self.summary)


def write_run(run_dir: str | os.PathLike, policy_map: policies.DTypePolicyMap, profile: Any, frontier: Any,
              summary: dict[str, Any]) -> None:
    """Writes a run directory's four files, each atomically (``TuneResult.save`` uses it).

    With several JAX processes only process 0 writes (the others hold the same result)."""
    if not _multihost.is_writer():
        return
    os.makedirs(run_dir, exist_ok=True)
    _atomic.write_text(os.path.join(run_dir, PROFILE_FILE), profile.to_csv(index=False))
    _atomic.write_text(os.path.join(run_dir, FRONTIER_FILE), frontier.to_csv(index=False))
    policies.save_policy_map(policy_map, os.path.join(run_dir, MAP_FILE))
    _atomic.write_json(os.path.join(run_dir, SUMMARY_FILE), _json_safe(summary))


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> None:
    """Rewrites ``summary.json`` alone, atomically (figures known after :func:`write_run`);
    only process 0 writes."""
    if not _multihost.is_writer():
        return
    _atomic.write_json(os.path.join(run_dir, SUMMARY_FILE), _json_safe(summary))


def load_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Reads a run directory back: ``{"profile", "frontier", "policy_map", "summary"}``.

    Raises:
      FileNotFoundError: if ``run_dir`` or one of its files is missing.
    """
    import pandas as pd  # pylint: disable=import-outside-toplevel

    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"No run directory at {os.fspath(run_dir)!r}")
    with open(os.path.join(run_dir, SUMMARY_FILE), encoding="utf-8") as f:
        summary = json.load(f)
    return {
        "profile": pd.read_csv(os.path.join(run_dir, PROFILE_FILE)),
        "frontier": pd.read_csv(os.path.join(run_dir, FRONTIER_FILE)),
        "policy_map": policies.load_policy_map(os.path.join(run_dir, MAP_FILE)),
        "summary": summary,
    }
