"""Speed-ups with stated confidence, from paired timing rounds.

Two configurations timed in the same rounds (see :class:`~autopolicy.search.timing.Timer`) give
one ratio per round; the speed-up is the median ratio and its interval a seeded percentile
bootstrap of that median. A configuration replaces another only when the interval's lower bound
clears the margin, so a change made inside timing noise is not made.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

__all__ = ["Speedup", "paired_speedup", "CONFIDENCE"]

CONFIDENCE = 0.95
RESAMPLES = 2000


@dataclasses.dataclass(frozen=True)
class Speedup:
    """How much faster a candidate is than a reference: ``reference time / candidate time``."""

    median: float
    low: float
    high: float
    rounds: int
    confidence: float = CONFIDENCE

    def clears(self, margin: float) -> bool:
        """Faster by at least ``margin`` with the stated confidence."""
        return self.low >= margin

    def straddles(self, margin: float) -> bool:
        """Neither clearly above nor clearly below ``margin``: more rounds may decide."""
        return self.low < margin <= self.high

    def __str__(self) -> str:
        return f"{self.median:.3f}x [{self.low:.3f}, {self.high:.3f}] over {self.rounds} rounds"


def paired_speedup(reference: Sequence[float], candidate: Sequence[float], confidence: float = CONFIDENCE,
                   resamples: int = RESAMPLES, seed: int = 0) -> Speedup:
    """The speed-up of ``candidate`` over ``reference`` from per-round seconds of the same rounds.

    Args:
      reference, candidate: Seconds per call, round by round (equal lengths, >= 3).
      confidence: The interval's coverage.
      resamples: Bootstrap resamples.
      seed: Seeds the bootstrap (the interval is reproducible).

    >>> s = paired_speedup([2.0, 2.1, 1.9, 2.0, 2.2], [1.0, 1.0, 1.0, 1.1, 1.0])
    >>> round(s.median, 2), s.low <= s.median <= s.high, s.rounds
    (2.0, True, 5)
    """
    ref = np.asarray(reference, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    if ref.shape != cand.shape or ref.ndim != 1 or ref.size < 3:
        raise ValueError(f"paired_speedup needs two equally long series of >= 3 rounds. "
                         f"Received lengths {ref.size} and {cand.size}.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1). Received: confidence={confidence!r}")
    ratios = ref / cand
    rng = np.random.default_rng(seed)
    medians = np.median(ratios[rng.integers(0, ratios.size, size=(resamples, ratios.size))], axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(medians, [tail, 1 - tail])
    median = float(np.median(ratios))
    if not math.isfinite(median):
        raise ValueError("paired_speedup received non-finite or zero timings.")
    return Speedup(median, float(low), float(high), int(ratios.size), confidence)
