"""A latency model calibrated on end-to-end timings.

Layers timed alone do not add up to the whole model: fusion, overheads outside the tuned
layers and caches make the sum of isolated latencies wrong by up to 2x. Where the model's weights
exceed the last-level cache, each layer's latency is first floored by its weight bytes over the
device's streaming bandwidth (``LatencyProfile.latency_s``): one scale per policy cannot say that
a small float32 layer that ran from the L2 cache alone streams from memory in the model. The
model predicts a configuration as ``sum over layers of scale[policy] * latency + casts`` and fits one
scale per policy by least squares of relative errors on every configuration timed end to end
(the uniform policies give one equation per policy, so the fit is always determined; verified
maps over-determine it).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from autopolicy import policies
from autopolicy.search._defaults import REFERENCE
from autopolicy.search.phases import LatencyProfile

__all__ = ["Calibration", "fit", "raw_terms"]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One scale per policy (1.0: the isolated latencies are right)."""

    scale: Mapping[str, float]
    configurations: int = 0  # how many end-to-end timings it was fitted on

    def factor(self, policy: str) -> float:
        return self.scale.get(policy, self.scale.get(REFERENCE, 1.0))

    def predict(self, latency: LatencyProfile, assignment: Mapping[str, str]) -> float:
        """Calibrated seconds for an assignment (missing layers: float32)."""
        layer_terms, casts = raw_terms(latency, assignment)
        return casts + sum(self.factor(p) * s for p, s in layer_terms.items())


IDENTITY = Calibration({})


def raw_terms(latency: LatencyProfile, assignment: Mapping[str, str]) -> tuple[dict[str, float], float]:
    """Summed layer latencies (``LatencyProfile.latency_s``: isolated, floored by weight streaming)
    per policy, and the summed casts, of an assignment."""
    terms: dict[str, float] = {}
    casts, previous = 0.0, REFERENCE
    for site in latency.sites:
        name = assignment.get(site.path, REFERENCE)
        dtype = policies.get(name).compute_dtype
        source = previous if site.chained else REFERENCE
        terms[name] = terms.get(name, 0.0) + latency.latency_s(site, name)
        casts += 0.0 if source == dtype else latency.site_casts(site).get((source, dtype), 0.0)
        previous = dtype
    return terms, casts


def fit(latency: LatencyProfile, timed: Sequence[tuple[Mapping[str, str], float]]) -> Calibration:
    """Fits the per-policy scales on ``(assignment, measured seconds)`` pairs.

    A policy no timed configuration uses keeps the float32 scale; a fitted scale that is not
    positive (a degenerate fit) falls back to it too.
    """
    rows = [raw_terms(latency, assignment) + (seconds,) for assignment, seconds in timed if seconds > 0]
    names = sorted({p for terms, _, _ in rows for p, s in terms.items() if s > 0})
    if not rows or not names:
        return IDENTITY
    a = np.array([[terms.get(p, 0.0) / seconds for p in names] for terms, _, seconds in rows])
    b = np.array([(seconds - casts) / seconds for _, casts, seconds in rows])
    solution, *_ = np.linalg.lstsq(a, b, rcond=None)
    scale = {p: float(v) for p, v in zip(names, solution)}
    fallback = scale.get(REFERENCE, 1.0) if scale.get(REFERENCE, 1.0) > 0 else 1.0
    return Calibration({p: (v if v > 0 else fallback) for p, v in scale.items()}, len(rows))
