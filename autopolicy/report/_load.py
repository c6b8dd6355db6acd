"""Reading a run directory for a report, with errors that name the file at fault."""

from __future__ import annotations

import json
import os
from typing import Any

import pandas as pd

from autopolicy import policies
from autopolicy.search.result import FRONTIER_FILE, MAP_FILE, PROFILE_FILE, SUMMARY_FILE

__all__ = ["read_run", "PROFILE_COLUMNS", "FRONTIER_COLUMNS", "SUMMARY_KEYS"]

# What the report reads; a file without one of these is malformed.
PROFILE_COLUMNS = ("layer", "policy", "latency_s", "nbytes", "accuracy_cost", "status", "chosen")
FRONTIER_COLUMNS = ("predicted_metric", "predicted_latency_s")
SUMMARY_KEYS = ("device", "budget", "chosen", "float32", "uniform")
_TRUTH = {True: True, False: False, "True": True, "False": False, "true": True, "false": False}


def _require_file(run_dir: str, name: str) -> str:
    path = os.path.join(run_dir, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"The run directory {run_dir!r} has no {name} (expected {path!r}).")
    return path


def _read_csv(path: str, columns: tuple[str, ...], allow_empty: bool = False) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError as e:
        # TuneResult.save writes an empty table (no frontier under the memory budget) as "\n".
        if allow_empty:
            return pd.DataFrame(columns=list(columns))
        raise ValueError(f"{path!r} is empty: {e}") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ValueError(f"{path!r} is not a readable CSV table: {e}") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(
            f"{path!r} lacks the columns {missing}. Expected at least {list(columns)}; "
            f"found {list(frame.columns)}."
        )
    return frame


def _check_profile(path: str, profile: pd.DataFrame) -> pd.DataFrame:
    if profile.empty:
        raise ValueError(f"{path!r} has no rows: the run measured no layer.")
    duplicated = profile[profile.duplicated(["layer", "policy"])]
    if not duplicated.empty:
        first = duplicated.iloc[0]
        raise ValueError(f"{path!r} has several rows for layer={first['layer']!r}, policy={first['policy']!r}.")
    chosen = profile["chosen"].map(_TRUTH.get)
    if chosen.isna().any():
        bad = profile["chosen"][chosen.isna()].iloc[0]
        raise ValueError(f"{path!r}: 'chosen' must be True or False. Received: {bad!r}")
    return profile.assign(chosen=chosen.astype(bool))


def _read_summary(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{path!r} must hold a JSON object. Received a {type(summary).__name__}.")
    missing = [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise ValueError(f"{path!r} lacks the keys {missing}. Expected at least {list(SUMMARY_KEYS)}.")
    for key in ("budget", "chosen", "float32", "uniform"):
        if not isinstance(summary[key], dict):
            raise ValueError(f"{path!r}: {key!r} must be an object. Received: {summary[key]!r}")
    return summary


def _read_map(path: str) -> policies.DTypePolicyMap:
    try:
        return policies.load_policy_map(path)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path!r} is not a valid policy map: {e}") from None


def read_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Reads and checks a run directory written by :meth:`autopolicy.search.TuneResult.save`.

    Args:
      run_dir: The run directory.

    Returns:
      ``{"profile": DataFrame, "frontier": DataFrame, "policy_map": DTypePolicyMap,
      "summary": dict}``, as :func:`autopolicy.search.load_run` returns it.

    Raises:
      FileNotFoundError: if ``run_dir`` or one of its four files is missing.
      ValueError: if a file is not valid JSON/CSV or lacks what a report needs.
    """
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"No run directory at {run_dir!r}.")
    paths = {name: _require_file(run_dir, name) for name in
             (PROFILE_FILE, FRONTIER_FILE, MAP_FILE, SUMMARY_FILE)}
    profile = _check_profile(paths[PROFILE_FILE], _read_csv(paths[PROFILE_FILE], PROFILE_COLUMNS))
    return {
        "profile": profile,
        "frontier": _read_csv(paths[FRONTIER_FILE], FRONTIER_COLUMNS, allow_empty=True),
        "policy_map": _read_map(paths[MAP_FILE]),
        "summary": _read_summary(paths[SUMMARY_FILE]),
    }
