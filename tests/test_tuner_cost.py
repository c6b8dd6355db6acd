"""The tuner's own cost: phase wall times and XLA compilations in the summary, and the
machine-wide cache that lets a second run on the same machine reuse compilations and timings."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest

import autopolicy.nn as nn
from autopolicy import _machine_cache, experiment, search
from autopolicy.adapters.nn import NNAdapter
from autopolicy.nn import _parts
from autopolicy.search import accuracy, sensitivity
from autopolicy.search.cache import MeasurementCache
from autopolicy.search.costs import PHASES, Costs, phase
from tests.helpers import gaussian

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_nested_phases_charge_the_innermost_and_add_up_to_the_wall_time():
    costs = Costs()
    start = time.perf_counter()
    with costs, phase("verify"):
        time.sleep(0.05)
        with phase("solve"):
            time.sleep(0.1)
        time.sleep(0.05)
    wall = time.perf_counter() - start
    assert set(costs.seconds) == {"verify", "solve"}
    assert 0.1 <= costs.seconds["solve"] < 0.1 + 0.05  # the sleep, give or take scheduling
    assert 0.1 <= costs.seconds["verify"] < 0.15  # its own 0.1 s, not the nested 0.1 s
    assert costs.seconds["verify"] + costs.seconds["solve"] == pytest.approx(wall, abs=0.01)
    assert list(costs.as_dict()["phases_s"]) == ["solve", "verify"]  # PHASES order


def test_phase_outside_an_active_costs_charges_nothing_and_unknown_phases_are_refused():
    costs = Costs()
    with phase("solve"):  # nothing active
        pass
    assert costs.seconds == {}
    with pytest.raises(ValueError, match=r"'sovle'.*'solve'"):
        with costs, phase("sovle"):
            pass
    with pytest.raises(ValueError, match="'tea'"):
        costs.add("tea", 1.0)
    assert PHASES[0] == "checks" and PHASES[-1] == "report"


def test_compilations_are_counted_while_active_only():
    x = np.arange(7, dtype=np.float32)  # a shape no other test compiles this function for
    f = jax.jit(lambda a: a * 3.0 + 1.0)
    costs = Costs()
    with costs:
        np.testing.assert_allclose(np.asarray(f(x)), x * 3.0 + 1.0)
        f(x).block_until_ready()  # cached in memory: no second compilation
    assert costs.compilations == 1
    assert costs.compile_s > 0.0
    f(np.arange(9, dtype=np.float32)).block_until_ready()  # after exit: not counted
    assert costs.compilations == 1
    with pytest.raises(RuntimeError, match="already active"):
        with costs:
            with costs:
                pass


def test_shared_measurements_are_reused_by_another_run_directory_and_copied_into_it(tmp_path):
    shared = tmp_path / "machine" / "measurements.json"
    with MeasurementCache(tmp_path / "run1", shared) as cache:
        cache.put("latency-key", {"latency_s": 1.5e-3}, share=True)
        cache.get_or_measure("accuracy-key", lambda: 0.93)  # model-specific: stays in the run
    assert json.loads(shared.read_text()) == {"latency-key": {"latency_s": 1.5e-3}}
    with MeasurementCache(tmp_path / "run2", shared) as cache:
        assert cache.lookup("latency-key") == {"latency_s": 1.5e-3}
        assert cache.lookup("accuracy-key") is None
        assert (cache.hits, cache.shared_hits, cache.misses) == (1, 1, 0)
    own = json.loads((tmp_path / "run2" / "measurements.json").read_text())
    assert own == {"latency-key": {"latency_s": 1.5e-3}}  # the run directory stays complete
    with MeasurementCache(tmp_path / "run3") as cache:  # no shared file: nothing from it
        assert cache.lookup("latency-key") is None


def test_a_damaged_shared_file_is_measured_again_and_replaced(tmp_path):
    shared = tmp_path / "measurements.json"
    shared.write_text('{"half')
    with MeasurementCache(tmp_path / "run", shared) as cache:
        assert cache.lookup("k") is None
        cache.put("k", 2.0, share=True)
    assert json.loads(shared.read_text()) == {"k": 2.0}


def test_machine_cache_directory_follows_the_environment(monkeypatch):
    monkeypatch.setenv(_machine_cache.ENV, "/somewhere/else")
    assert _machine_cache.directory() == "/somewhere/else"
    home = os.path.join(os.path.expanduser("~"), ".cache", "autopolicy")
    monkeypatch.setenv(_machine_cache.ENV, "")
    assert _machine_cache.directory() == home
    monkeypatch.delenv(_machine_cache.ENV)
    assert _machine_cache.directory() == home == str(experiment.default_cache_dir())


TWO_LAYERS = textwrap.dedent('''
    """two layers on random data."""
    import jax, jax.numpy as jnp, numpy as np
    from autopolicy import nn
    from autopolicy.experiment import Experiment

    def build(cache_dir):
        x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 16)), jnp.float32)
        model = nn.Sequential([nn.Dense(32, activation="relu"), nn.Dense(4)], name="tiny")
        model = model.build(jax.random.key(0), x)
        reference = model(x)

        def fidelity(m):
            return 1.0 - float(jnp.mean(jnp.abs(m(x).astype(jnp.float32) - reference)))

        return Experiment(name="tiny", model=model, eval_fn=fidelity, sample_input=x,
                          candidates=("float32", "int8_from_float32"), max_drop=0.05)
''')


def _tune(tmp_path, out, *extra, machine_cache):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # the CLI's own
    env[_machine_cache.ENV] = str(machine_cache)
    exp = tmp_path / "tiny.py"
    exp.write_text(TWO_LAYERS)
    proc = subprocess.run([sys.executable, "-m", "autopolicy", "tune", str(exp), "--out", str(out), "--repeats", "3",
                           "--no-progress", *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_a_second_run_into_a_new_directory_reuses_compilations_and_timings_and_says_so(tmp_path):
    machine = tmp_path / "machine"
    first_out, first = _tune(tmp_path, tmp_path / "run1", machine_cache=machine)
    second_out, second = _tune(tmp_path, tmp_path / "run2", machine_cache=machine)
    for summary in (first, second):
        costs = summary["costs"]
        assert set(costs["phases_s"]) >= {"checks", "layer latency", "casts", "calibration", "verify", "report"}
        assert set(costs["phases_s"]) <= set(PHASES)
        assert all(seconds >= 0 for seconds in costs["phases_s"].values())
        assert costs["compilations"] > 10  # every layer under every candidate, the casts, the models
    assert first["costs"]["compile_cache_hits"] == 0 and first["cache"]["shared_hits"] == 0
    # The second run loads what the first compiled and reuses its layer and cast timings.
    assert second["costs"]["compile_cache_hits"] >= second["costs"]["compilations"] // 2
    assert second["cache"]["shared_hits"] >= 4  # 2 layers x 2 policies at least
    assert "from the machine-wide cache of earlier runs" in second_out
    assert "loaded from the compilation cache" in second_out and "XLA compilations" in first_out
    assert os.listdir(machine / "jax") and (machine / "measurements" / "measurements.json").exists()
    assert "Where the tuning time went" in (tmp_path / "run2" / "report.md").read_text()
    # Opting out: nothing read from or added to the machine-wide cache; the run directory
    # holds its own compilation cache.
    before = (machine / "measurements" / "measurements.json").read_text()
    _, alone = _tune(tmp_path, tmp_path / "run3", "--no-shared-cache", "--no-report", machine_cache=machine)
    assert alone["cache"]["shared_hits"] == 0
    assert (machine / "measurements" / "measurements.json").read_text() == before
    assert os.listdir(tmp_path / "run3" / "cache" / "jax")


@pytest.mark.slow
def test_sensitivity_compiles_each_candidate_ahead_and_scores_it_compiled(monkeypatch):
    """With an adapter that has no ``scoring_model`` (Keras, Flax), while one candidate is
    scored, the next one's model compiles in the compile pool: scoring (its calibration outputs
    and an eval_fn on batches of that shape) compiles nothing more."""
    monkeypatch.delattr(NNAdapter, "scoring_model")
    x = gaussian((16, 24), seed=11)
    model = nn.Sequential([nn.Dense(32, activation="relu", name="a"), nn.Dense(8, name="b")], name="m")
    model = model.build(jax.random.key(2), x)
    y = np.asarray(model(x))
    ahead, in_scoring, scoring = [], [], threading.local()
    prefetch, score = sensitivity.Scorer.prefetch, accuracy._score

    def counted(self, candidate):
        ahead.append(prefetch(self, candidate))
        return ahead[-1]

    def scored(*args, **kwargs):
        scoring.on = True
        try:
            return score(*args, **kwargs)
        finally:
            scoring.on = False

    def on_compile(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and getattr(scoring, "on", False):
            in_scoring.append(duration)  # a compilation on the scoring thread, while it scores

    monkeypatch.setattr(sensitivity.Scorer, "prefetch", counted)
    monkeypatch.setattr(accuracy, "_score", scored)
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        result = search.tune(model, lambda m: -float(np.mean((np.asarray(m(x)) - y) ** 2)), x,
                             candidates=["float32", "mixed_bfloat16", "int8_from_float32"], max_drop=0.5,
                             relative=False, calibration_inputs=[(x,)], profile_accuracy="always",
                             repeats=3, progress=False, confirm_seconds=0)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert result.accuracy.evaluations == 4  # two layers, two candidates each
    assert in_scoring == []
    assert len(ahead) == 4 and all(f.done() and f.exception() is None for f in ahead)


@pytest.mark.slow
def test_sensitivity_scores_nn_models_by_parts_and_a_repeated_layer_compiles_nothing(monkeypatch):
    """The nn adapter scores candidates compiled by parts: the candidate of ``c`` (the same
    layer as ``b`` but for its name) compiles nothing, and every score is the whole model's.
    (Parts of float8 layers, whose scales are a dict of arrays: tests/test_nn_module.py.)"""
    x = gaussian((13, 21), seed=12)  # this test's own shapes: no other test has compiled its parts
    model = nn.Sequential([nn.Dense(19, activation="relu", name=n) for n in "abc"], name="m").build(
        jax.random.key(4), x)
    y = np.asarray(model(x))
    compiled, models = {}, {}
    score = accuracy._score

    def counted(ctx, site, policy, candidate=None):
        start = _parts._jit_part._cache_size()  # pylint: disable=protected-access
        out = score(ctx, site, policy, candidate)
        compiled[site.path, policy.name] = _parts._jit_part._cache_size() - start  # pylint: disable=protected-access
        models[site.path, policy.name] = candidate
        return out

    def metric(m):
        return -float(np.mean((np.asarray(m(x)) - y) ** 2))

    monkeypatch.setattr(accuracy, "_score", counted)
    result = search.tune(model, metric, x, candidates=["float32", "int8_from_float32"], max_drop=0.5,
                         relative=False, calibration_inputs=[(x,)], profile_accuracy="always", repeats=3,
                         progress=False, confirm_seconds=0)
    assert result.accuracy.evaluations == 3
    assert all(m.compiles_by_parts for m in models.values())
    # a: its int8 part and b's (c's) float32 part; b: a's float32 part and its own int8 part;
    # c: nothing (b's parts).
    assert compiled == {("m/a", "int8_from_float32"): 2, ("m/b", "int8_from_float32"): 2,
                        ("m/c", "int8_from_float32"): 0}
    for (path, name), candidate in models.items():
        entry = result.accuracy.entries[path][name]
        assert entry.status == "measured"
        assert entry.metric == pytest.approx(metric(candidate.compiled_by_parts(False)), rel=1e-5)
