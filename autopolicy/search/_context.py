"""What every phase of one tuning run reads: the adapter, the scorer, the cache and the settings."""

from __future__ import annotations

import dataclasses
from typing import Any

from autopolicy import policies
from autopolicy.search.adapter import ModelAdapter
from autopolicy.search.cache import MeasurementCache
from autopolicy.search.phases import Budget
from autopolicy.search.sensitivity import Scorer

__all__ = ["Context"]


@dataclasses.dataclass(frozen=True)
class Context:
    """The fixed inputs of one run (the phases' results are passed explicitly)."""

    adapter: ModelAdapter
    scorer: Scorer
    cache: MeasurementCache
    fingerprint: str
    digest: str  # weights, calibration data and eval_fn: the key of every accuracy figure
    budget: Budget
    candidates: tuple[policies.DTypePolicy, ...]
    sample_args: tuple
    repeats: int
    max_rounds: int
    min_speedup: float
    confirm_seconds: float  # time allowed for extra end-to-end rounds that settle close calls
    progress: bool
    reference_model: Any  # the float32 model, as the adapter builds it
    executor: Any = None  # a concurrent.futures.Executor for one-layer evaluations, or None
    workload: Any = None  # with an executor: what its workers need (search.executor.Workload)
