"""The timing loop: one compilation, a runtime trip count, paired rounds, robust summaries."""

import jax
import jax.numpy as jnp
import pytest

from autopolicy.search import timing

X = jax.random.normal(jax.random.key(0), (64, 64))


def _counting_candidate(calls):
    def fn(state, x):
        jax.debug.callback(lambda: calls.append(1))
        return x @ state

    return timing.Candidate(fn, (X,), jnp.eye(64))


def test_the_trip_count_is_a_runtime_argument_of_one_compilation(monkeypatch):
    calls, compiles = [], []
    real_jit = jax.jit
    monkeypatch.setattr(timing.jax, "jit", lambda f, **kw: compiles.append(1) or real_jit(f, **kw))
    runner = timing.compile_loop(_counting_candidate(calls), inner=5)
    runner(3)
    assert len(calls) == 3
    calls.clear()
    runner()
    assert len(calls) == 5 and len(compiles) == 1


def test_rounds_are_paired_and_candidates_can_be_added_later():
    timer = timing.Timer({"a": timing.Candidate(lambda s, x: x @ x, (X,))}, warmup=1)
    timer.rounds(3)
    timer.add({"b": timing.Candidate(lambda s, x: (x @ x).astype(jnp.bfloat16), (X,))})
    timer.rounds(4)
    timer.rounds(2, ["b"])
    assert len(timer.samples["a"]) == 7 and len(timer.samples["b"]) == 6
    t = timer.timing("b")
    assert t.repeats == 6 and len(t.samples) == 6 and t.p25 <= t.median <= t.p75 and t.inner >= 1
    assert timer.cpu_per_wall > 0
    with pytest.raises(ValueError, match="already has a candidate named 'a'"):
        timer.add({"a": timing.Candidate(lambda s, x: x, (X,))})


def test_measure_needs_three_repeats():
    with pytest.raises(ValueError, match="repeats=2"):
        timing.measure({"a": timing.Candidate(lambda s, x: x, (X,))}, repeats=2)


def test_the_summary_is_robust_to_one_outlier():
    t = timing.summarize([1.0, 1.0, 1.1, 0.9, 1.0, 50.0])
    assert t.median == pytest.approx(1.0) and t.cv < 0.1 and t.samples[-1] == 50.0
