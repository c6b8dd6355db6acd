"""The exact per-layer policy assignment: a multiple-choice knapsack on a chain.

Choose one option per layer to minimize summed latency plus the cost of casting activations
where consecutive layers compute in different dtypes, subject to summed accuracy cost <= budget
(and optionally summed bytes <= a memory budget).

The dynamic program walks the layers in order. Its state is the compute dtype of the previous
layer (which decides the next cast); for each state it keeps the Pareto set of partial
assignments over (accuracy cost, bytes, latency). Dominated partial assignments can never
become optimal, so pruning them keeps the search exact, and the final Pareto set *is* the
latency/accuracy frontier: every budget is answered from it without solving again.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

__all__ = ["Option", "Layer", "Solution", "solve", "frontier", "total_cost"]

_EPS = 1e-12
# Past this many Pareto points in one state, the frontier is thinned to this resolution in
# accuracy cost (and marked inexact). Real models stay far below it; the cap bounds the worst case.
MAX_POINTS = 2000


@dataclasses.dataclass(frozen=True)
class Option:
    """One candidate policy for one layer."""

    policy: str
    dtype: str  # compute dtype: what the next layer receives
    latency: float
    accuracy_cost: float = 0.0
    nbytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class Layer:
    """A layer's options and the cost of entering it.

    ``chained``: its input is the previous layer's output, so entering in dtype ``d`` after a
    layer that produced dtype ``p`` costs ``casts.get((p, d), 0)``. Otherwise its input comes
    from the model (float32), and entering in ``d`` costs ``casts.get(("float32", d), 0)``.
    """

    name: str
    options: tuple[Option, ...]
    chained: bool = True
    casts: dict = dataclasses.field(default_factory=dict)

    def entry_cost(self, previous_dtype: str, dtype: str) -> float:
        source = previous_dtype if self.chained else "float32"
        if source == dtype:
            return 0.0
        return self.casts.get((source, dtype), 0.0)


@dataclasses.dataclass(frozen=True)
class Solution:
    """A full assignment: the chosen option index per layer and its summed costs."""

    choice: tuple[int, ...]
    latency: float
    accuracy_cost: float
    nbytes: float
    exact: bool = True

    def policies(self, layers: Sequence[Layer]) -> dict[str, str]:
        return {layer.name: layer.options[i].policy for layer, i in zip(layers, self.choice)}


@dataclasses.dataclass(frozen=True)
class _Point:
    accuracy_cost: float
    nbytes: float
    latency: float
    parent: "_Point | None"
    option: int


def total_cost(layers: Sequence[Layer], choice: Sequence[int], input_dtype: str = "float32") -> Solution:
    """The summed costs of one assignment (what the dynamic program minimizes)."""
    latency = accuracy = nbytes = 0.0
    previous = input_dtype
    for layer, index in zip(layers, choice):
        option = layer.options[index]
        latency += option.latency + layer.entry_cost(previous, option.dtype)
        accuracy += option.accuracy_cost
        nbytes += option.nbytes
        previous = option.dtype
    return Solution(tuple(choice), latency, accuracy, nbytes)


def _prune(points: list[_Point], use_bytes: bool) -> list[_Point]:
    """Keeps the points no other point beats on every axis."""
    points.sort(key=lambda p: (p.accuracy_cost, p.nbytes if use_bytes else 0.0, p.latency))
    kept: list[_Point] = []
    if not use_bytes:
        best = math.inf
        for p in points:
            if p.latency < best - _EPS:
                kept.append(p)
                best = p.latency
        return kept
    for p in points:
        if not any(q.nbytes <= p.nbytes + _EPS and q.latency <= p.latency + _EPS for q in kept):
            kept.append(p)
    return kept


def _thin(points: list[_Point]) -> list[_Point]:
    """Keeps the fastest point per accuracy-cost bucket (MAX_POINTS buckets)."""
    low, high = points[0].accuracy_cost, points[-1].accuracy_cost
    width = (high - low) / MAX_POINTS or 1.0
    best: dict[int, _Point] = {}
    for p in points:
        bucket = int((p.accuracy_cost - low) / width)
        if bucket not in best or p.latency < best[bucket].latency:
            best[bucket] = p
    return sorted(best.values(), key=lambda p: p.accuracy_cost)


def _pareto(
    layers: Sequence[Layer],
    budget: float,
    memory_budget: float | None,
    input_dtype: str,
) -> tuple[list[_Point], bool]:
    use_bytes = memory_budget is not None
    exact = True
    states: dict[str, list[_Point]] = {input_dtype: [_Point(0.0, 0.0, 0.0, None, -1)]}
    for layer in layers:
        if not layer.options:
            raise ValueError(f"Layer {layer.name!r} has no options.")
        nxt: dict[str, list[_Point]] = {}
        for previous, points in states.items():
            for index, option in enumerate(layer.options):
                step = option.latency + layer.entry_cost(previous, option.dtype)
                for p in points:
                    accuracy = p.accuracy_cost + option.accuracy_cost
                    nbytes = p.nbytes + option.nbytes
                    if accuracy > budget + _EPS * max(1.0, abs(budget)):
                        continue
                    if use_bytes and nbytes > memory_budget + _EPS * max(1.0, memory_budget):
                        continue
                    nxt.setdefault(option.dtype, []).append(_Point(accuracy, nbytes, p.latency + step, p, index))
        states = {dtype: _prune(points, use_bytes) for dtype, points in nxt.items()}
        for dtype, points in states.items():
            if len(points) > MAX_POINTS:
                states[dtype], exact = _thin(points), False
        if not states:
            return [], exact
    return _prune([p for points in states.values() for p in points], use_bytes), exact


def _solution(point: _Point, exact: bool) -> Solution:
    choice = []
    node: _Point | None = point
    while node is not None and node.option >= 0:
        choice.append(node.option)
        node = node.parent
    return Solution(tuple(reversed(choice)), point.latency, point.accuracy_cost, point.nbytes, exact)


def solve(
    layers: Sequence[Layer],
    budget: float,
    memory_budget: float | None = None,
    input_dtype: str = "float32",
) -> Solution | None:
    """The fastest assignment with summed accuracy cost <= ``budget`` (and bytes within
    ``memory_budget``), or None when no assignment fits.

    >>> layers = [
    ...     Layer("a", (Option("float32", "float32", 2.0), Option("int8", "float32", 1.0, 0.5))),
    ...     Layer("b", (Option("float32", "float32", 2.0), Option("int8", "float32", 1.5, 0.2))),
    ... ]
    >>> solve(layers, budget=0.5).choice
    (1, 0)
    >>> solve(layers, budget=0.7).choice
    (1, 1)
    """
    if budget < 0 or math.isnan(budget):
        raise ValueError(f"budget must be >= 0. Received: budget={budget!r}")
    if memory_budget is not None and not memory_budget >= 0:
        raise ValueError(f"memory_budget must be >= 0 or None. Received: memory_budget={memory_budget!r}")
    points, exact = _pareto(layers, budget, memory_budget, input_dtype)
    if not points:
        return None
    best = min(points, key=lambda p: (p.latency, p.accuracy_cost, p.nbytes))
    return _solution(best, exact)


def frontier(
    layers: Sequence[Layer], memory_budget: float | None = None, input_dtype: str = "float32"
) -> list[Solution]:
    """Every assignment on the latency/accuracy-cost Pareto frontier, cheapest accuracy first.

    The fastest assignment within any budget ``b`` is the last frontier point whose accuracy
    cost is <= ``b``: sweeping the budget needs no further solving.
    """
    points, exact = _pareto(layers, math.inf, memory_budget, input_dtype)
    points = _prune(points, False)
    return [_solution(p, exact) for p in sorted(points, key=lambda p: p.accuracy_cost)]
