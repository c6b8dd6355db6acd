"""The outcome of a tuning run and the run directory it writes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from autopolicy import _atomic, policies

__all__ = ["TuneResult", "PROFILE_FILE", "FRONTIER_FILE", "MAP_FILE", "SUMMARY_FILE", "load_run"]

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
    """What :func:`autopolicy.search.tune` found.

    Attributes:
      policy_map: The chosen per-layer policies (a ``DTypePolicyMap`` keyed by layer path).
      model: The model with the map applied (and float8 scales calibrated).
      profile: One row per layer and candidate policy: latency, accuracy cost, fidelity, bytes.
      frontier: The predicted latency/accuracy-cost Pareto frontier of per-layer assignments.
      summary: Hardware, budget, predicted and measured figures for the map and each uniform
        policy, evaluation counts, wall time.
    """

    policy_map: policies.DTypePolicyMap
    model: Any
    profile: Any  # pandas.DataFrame
    frontier: Any  # pandas.DataFrame
    summary: dict[str, Any]

    def save(self, run_dir: str | os.PathLike) -> None:
        """Writes ``profile.csv``, ``frontier.csv``, ``policy_map.json`` (Keras envelope) and
        ``summary.json`` into ``run_dir``, each atomically."""
        os.makedirs(run_dir, exist_ok=True)
        _atomic.write_text(os.path.join(run_dir, PROFILE_FILE), self.profile.to_csv(index=False))
        _atomic.write_text(os.path.join(run_dir, FRONTIER_FILE), self.frontier.to_csv(index=False))
        policies.save_policy_map(self.policy_map, os.path.join(run_dir, MAP_FILE))
        _atomic.write_json(os.path.join(run_dir, SUMMARY_FILE), _json_safe(self.summary))


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
