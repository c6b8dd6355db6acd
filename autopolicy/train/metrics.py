"""Metrics over whole datasets: each takes all targets and all predictions."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["accuracy", "get", "NAMES"]


def accuracy(targets: np.ndarray, predictions: np.ndarray) -> float:
    """Fraction of rows whose argmax matches the integer target (or one-hot target's argmax)."""
    targets = np.asarray(targets)
    predictions = np.asarray(predictions, np.float32)
    if targets.ndim == predictions.ndim:
        targets = targets.argmax(-1)
    return float(np.mean(predictions.argmax(-1) == targets))


NAMES: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {"accuracy": accuracy}


def get(identifier: Any) -> Callable[[np.ndarray, np.ndarray], float]:
    if callable(identifier):
        return identifier
    if isinstance(identifier, str) and identifier in NAMES:
        return NAMES[identifier]
    raise ValueError(f"Unknown metric. Expected one of {tuple(NAMES)} or a callable. Received: {identifier!r}")
