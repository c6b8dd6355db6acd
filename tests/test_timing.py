"""The timing loop: one compilation, a runtime trip count, paired rounds, robust summaries."""

import jax
import jax.numpy as jnp
import pytest

from autopolicy.search import timing

from helpers import on_cpu_backend, ops_outside_loops, tiny_two_layer

X = jax.random.normal(jax.random.key(0), (64, 64))


def _counting_candidate(calls):
    def fn(state, x):
        jax.debug.callback(lambda: calls.append(1))
        return x @ state

    return timing.Candidate(fn, (X,), jnp.eye(64))


@on_cpu_backend  # one call per iteration on CPUs (GPUs unroll the loop)
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


def test_off_a_cpu_each_iteration_runs_several_dependent_calls(monkeypatch):
    monkeypatch.setattr(timing, "_platform", lambda candidate: "gpu")
    calls = []
    runner = timing.compile_loop(_counting_candidate(calls))
    runner(3)
    assert runner.calls_per_iteration == timing.UNROLL == 8 and len(calls) == 24
    timer = timing.Timer({"a": _counting_candidate([])}, warmup=1)
    assert timer.runners["a"][1] % 8 == 0  # calls per timed call, by which each sample is divided


@pytest.mark.slow
def test_a_tune_with_a_gpus_timing_rules_unrolls_layers_but_not_models(monkeypatch, tmp_path):
    from autopolicy import search  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(timing, "_platform", lambda candidate: "gpu")
    unrolls, real = [], timing.compile_loop

    def recording(candidate, inner=None, unroll=None):
        runner = real(candidate, inner, unroll)
        unrolls.append(runner.calls_per_iteration)
        return runner

    monkeypatch.setattr(timing, "compile_loop", recording)
    model, fidelity, x = tiny_two_layer()
    result = search.tune(model, fidelity, x, candidates=["float32", "int8_from_float32"], max_drop=0.5,
                         relative=False, repeats=3, progress=False, cache_dir=str(tmp_path))
    assert all(inner % timing.UNROLL == 0 for inner in result.profile["inner"])  # calls per timed call
    assert set(unrolls) == {1, timing.UNROLL}  # the end-to-end models: one call an iteration
    assert result.summary["float32"]["measured_latency_s"] > 0


def test_the_layer_runs_inside_the_loop_not_hoisted_out_of_it():
    runner = timing.compile_loop(timing.Candidate(lambda w, x: x @ w, (X,), jnp.eye(64)))
    text = runner.ready().as_text()
    assert " while(" in text and ops_outside_loops(text) == []
    # The check itself sees a dot outside a loop.
    plain = jax.jit(lambda w, x: x @ w).lower(jnp.eye(64), X).compile().as_text()
    assert len(ops_outside_loops(plain)) == 1


class _Clock:
    """A call of ``n`` iterations takes ``fixed + n * per_iteration`` fake seconds."""

    def __init__(self, fixed, per_iteration):
        self.now, self.fixed, self.per_iteration = 0.0, fixed, per_iteration

    def perf_counter(self):
        return self.now

    def runner(self, n):
        self.now += self.fixed + n * self.per_iteration


@pytest.mark.parametrize("fixed, per_iteration, expected", [
    (0.0, 1e-4, 20),        # no fixed cost: 2 ms of iterations
    (4e-4, 5e-6, 1600),     # a GPU's launch and sync around a 5 us layer: fixed cost <= 5%
    (0.0, 3e-3, 1),         # one iteration already lasts the target, with no fixed cost
    (1e-3, 6.3e-3, 2),      # a CPU's 1 ms around a 6.3 ms Dense: calls of at most 5 targets
    (1e-3, 11e-3, 1),       # one iteration lasts 5 targets: not estimated further
    (1e-3, 1e-7, 10000),    # capped at MAX_INNER
])
def test_the_iterations_per_call_leave_the_fixed_cost_a_small_share(monkeypatch, fixed, per_iteration, expected):
    clock = _Clock(fixed, per_iteration)
    monkeypatch.setattr(timing, "time", clock)
    assert timing.choose_inner(clock.runner, target_seconds=2e-3) == expected


def test_on_a_cpu_the_fixed_cost_counts_as_work(monkeypatch):
    # Work XLA hoisted out of the loop (a weight reorder) is paid by a model in every call.
    clock = _Clock(4e-4, 5e-6)
    monkeypatch.setattr(timing, "time", clock)
    assert timing.choose_inner(clock.runner, target_seconds=2e-3, fixed_is_work=True) == 5


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


def _counting_step(seen):
    """A stateful step: ``x @ w`` and a counter it increments, recorded at every call."""

    def fn(state, x, counter):
        jax.debug.callback(lambda c: seen.append(int(c)), counter)
        return x @ state, counter + 1

    return fn


def test_a_carried_step_feeds_its_state_forward_within_and_across_calls():
    seen = []
    counter = jnp.asarray(7, jnp.int32)
    cand = timing.Candidate(_counting_step(seen), (X, counter), jnp.eye(64), carry=lambda inputs, out: (inputs[0], out[1]))
    run = timing.compile_loop(cand, inner=3)
    run()
    assert seen == [7, 8, 9]  # each step reads the counter the one before wrote
    run(2)
    assert seen == [7, 8, 9, 10, 11]  # and each call starts where the last stopped
    run(1)  # one step runs alone, not as a loop of one, from the same state
    assert seen == [7, 8, 9, 10, 11, 12]
    assert int(counter) == 7 and float(X[0, 0]) == float(jax.random.normal(jax.random.key(0), (64, 64))[0, 0])


def test_a_carry_that_changes_the_inputs_structure_or_shapes_is_refused():
    bad_structure = timing.Candidate(_counting_step([]), (X, jnp.asarray(0)), jnp.eye(64), carry=lambda i, o: (o[1],))
    with pytest.raises(ValueError, match="must return the inputs' structure"):
        timing.compile_loop(bad_structure)
    bad_shape = timing.Candidate(_counting_step([]), (X, jnp.asarray(0)), jnp.eye(64), carry=lambda i, o: (o[0][:2], o[1]))
    with pytest.raises(ValueError, match="must keep the inputs' shapes and dtypes"):
        timing.compile_loop(bad_shape)


def test_a_timer_runs_a_stateful_step_several_to_a_call():
    """A decoding loop runs its steps back to back: a carried candidate's timed call runs at
    least CARRIED_STEPS steps (one step a call carried the call's own cost into the step's)."""
    seen = []
    cand = timing.Candidate(_counting_step(seen), (X, jnp.asarray(0, jnp.int32)), jnp.eye(64),
                            carry=lambda inputs, out: (inputs[0], out[1]))
    timer = timing.Timer({"step": cand}, warmup=0)
    runner, inner = timer.runners["step"]
    assert inner >= timing.CARRIED_STEPS == 8
    before = len(seen)
    runner()
    assert len(seen) - before == inner  # one call, `inner` consecutive steps
    assert seen[-inner:] == list(range(seen[-inner], seen[-inner] + inner))
