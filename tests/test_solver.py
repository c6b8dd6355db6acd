"""The exact solver against brute force, and its frontier."""

import itertools
import math
import random

import pytest

from autopolicy.search import solver
from autopolicy.search.solver import Layer, Option

DTYPES = ["float32", "bfloat16", "float16"]


def random_problem(rng, n_layers, n_options):
    layers = []
    for i in range(n_layers):
        options = [Option("float32", "float32", rng.uniform(1, 2), 0.0, 4.0)]
        for j in range(n_options - 1):
            options.append(Option(f"p{j}", rng.choice(DTYPES), rng.uniform(0.2, 2.5),
                                  rng.choice([0.0, rng.uniform(0, 0.1)]), rng.choice([1.0, 2.0, 4.0])))
        casts = {(a, b): rng.uniform(0, 0.4) for a in DTYPES for b in DTYPES if a != b}
        layers.append(Layer(f"layer{i}", tuple(options), chained=rng.random() < 0.7, casts=casts))
    return layers


def brute_force(layers, budget, memory_budget=None):
    best = None
    for choice in itertools.product(*[range(len(layer.options)) for layer in layers]):
        s = solver.total_cost(layers, choice)
        if s.accuracy_cost <= budget + 1e-12 and (memory_budget is None or s.nbytes <= memory_budget + 1e-12):
            if best is None or s.latency < best.latency - 1e-12:
                best = s
    return best


def test_solver_equals_brute_force_on_200_random_instances():
    rng = random.Random(0)
    with_transitions = infeasible = 0
    for _ in range(200):
        layers = random_problem(rng, rng.randint(1, 5), rng.randint(1, 4))
        budget = rng.uniform(0, 0.2)
        memory = rng.choice([None, rng.uniform(len(layers), 4 * len(layers))])
        expected = brute_force(layers, budget, memory)
        got = solver.solve(layers, budget, memory)
        if expected is None:
            infeasible += 1
            assert got is None
            continue
        assert got.latency == pytest.approx(expected.latency, abs=1e-9)
        again = solver.total_cost(layers, got.choice)  # the reported costs are the real ones
        assert again.latency == pytest.approx(got.latency, abs=1e-9)
        assert again.accuracy_cost <= budget + 1e-9
        assert memory is None or again.nbytes <= memory + 1e-9
        with_transitions += any(layers[i].entry_cost(
            layers[i - 1].options[got.choice[i - 1]].dtype if i else "float32",
            layers[i].options[got.choice[i]].dtype) > 0 for i in range(len(layers)))
    assert with_transitions > 20  # the instances exercise the cast costs
    assert infeasible > 0  # and memory budgets that cannot be met


def test_transition_costs_can_make_a_slower_layer_worth_it():
    casts = {("bfloat16", "float32"): 1.0, ("float32", "bfloat16"): 1.0}
    bf16, f32 = Option("bf16", "bfloat16", 1.0), Option("float32", "float32", 0.9)
    layers = [Layer("a", (Option("float32", "float32", 5.0), Option("bf16", "bfloat16", 1.0)), casts=casts),
              Layer("b", (f32, bf16), casts=casts),
              Layer("c", (Option("float32", "float32", 5.0), Option("bf16", "bfloat16", 1.0)), casts=casts)]
    best = solver.solve(layers, budget=0.0)
    # A greedy per-layer choice would pick float32 for "b" (0.9 < 1.0) and pay two casts.
    assert best.policies(layers) == {"a": "bf16", "b": "bf16", "c": "bf16"}
    assert best.latency == pytest.approx(1.0 + 1.0 + 1.0 + 1.0)  # one cast into "a"


def test_frontier_answers_every_budget():
    rng = random.Random(1)
    layers = random_problem(rng, 5, 4)
    points = solver.frontier(layers)
    costs = [p.accuracy_cost for p in points]
    latencies = [p.latency for p in points]
    assert costs == sorted(costs) and latencies == sorted(latencies, reverse=True)
    assert all(p.exact for p in points)
    for budget in [0.0, 0.01, 0.05, 0.1, 0.3, math.inf]:
        best_on_frontier = min((p.latency for p in points if p.accuracy_cost <= budget), default=None)
        solved = solver.solve(layers, budget)
        assert (solved is None) == (best_on_frontier is None)
        if solved is not None:
            assert solved.latency == pytest.approx(best_on_frontier, abs=1e-12)


def test_invalid_budgets():
    layers = [Layer("a", (Option("float32", "float32", 1.0),))]
    with pytest.raises(ValueError, match="budget=-0.1"):
        solver.solve(layers, -0.1)
    with pytest.raises(ValueError, match="memory_budget"):
        solver.solve(layers, 0.1, memory_budget=-1)


def _int(latency, cost, nbytes, name="int8"):
    return Option(name, "float32", latency, cost, nbytes)


@pytest.mark.parametrize("accuracy_budget, memory_budget, expected", [
    (math.inf, None, {}),  # float32 is the fastest on every layer
    (math.inf, 650.0, {"a": "int8"}),  # saving 250 bytes at the least slowdown
    (0.1, 650.0, {"b": "int8"}),  # int8 on a breaks the accuracy budget
    (0.1, 530.0, {"b": "int8", "c": "int8"}),
    (0.1, 520.0, None),  # the two budgets together: nothing fits
])
def test_the_memory_budget_is_a_hard_constraint_beside_the_accuracy_budget(accuracy_budget, memory_budget,
                                                                            expected):
    # 900 bytes in float32 (400 + 400 + 100), faster than int8 on every layer.
    layers = [Layer("a", (Option("float32", "float32", 1.0, 0.0, 400.0), _int(1.1, 0.2, 100.0))),
              Layer("b", (Option("float32", "float32", 1.0, 0.0, 400.0), _int(1.3, 0.05, 100.0))),
              Layer("c", (Option("float32", "float32", 1.0, 0.0, 100.0), _int(1.05, 0.05, 25.0)))]
    solved = solver.solve(layers, accuracy_budget, memory_budget)
    if expected is None:
        assert solved is None and brute_force(layers, accuracy_budget, memory_budget) is None
        return
    assert {k: v for k, v in solved.policies(layers).items() if v != "float32"} == expected
    assert memory_budget is None or solved.nbytes <= memory_budget
    assert solved.accuracy_cost <= accuracy_budget
    assert solved.latency == pytest.approx(brute_force(layers, accuracy_budget, memory_budget).latency)
