"""Metrics where lower is better (perplexity, loss): ``tune(..., higher_is_better=False)`` reads
``max_drop`` as the allowed rise everywhere (costs, solver, verification, summary, report, CLI);
bad values are named. And the memory budget as a hard constraint beside the accuracy budget."""

import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopolicy import cli, search
from autopolicy.experiment import Experiment
from autopolicy.report.render import markdown as report_markdown
from autopolicy.search import _checks
from autopolicy.search.adapter import Program
from autopolicy.search.phases import Budget
from tests.test_adapter import PARAMS, X, TwoMatmuls, TwoMatmulsAdapter, _matmul, fidelity
from tests.test_decisions import QUICK, SlowFloat32Adapter
from tests.test_exclusions import W1, W2


def loss(model):
    """A lower-is-better metric of the two matmuls: 1 + their output error, plus 0.5 when w1
    computes in bfloat16 (far beyond any budget below), minus 0.05 when w2 does (a gain)."""
    w1, w2 = model.dtypes
    return 2.0 - fidelity(model) + (0.5 if w1 == "bfloat16" else 0.0) - (0.05 if w2 == "bfloat16" else 0.0)


# --- the budget in the metric's direction (no timing) ---------------------------------------------

@pytest.mark.parametrize("higher, metric, meets, drop", [
    (True, 0.89, True, 0.01), (True, 0.88, False, 0.02), (True, 0.95, True, -0.05),
    (False, 20.3, True, 0.3), (False, 20.5, False, 0.5), (False, 19.0, True, -1.0),
])
def test_budget_reads_the_allowed_change_in_the_metrics_direction(higher, metric, meets, drop):
    baseline, allowed = (0.9, 0.01) if higher else (20.0, 0.4)
    budget = Budget(baseline, allowed, higher_is_better=higher)
    assert budget.meets(metric) is meets
    assert budget.drop(metric) == pytest.approx(drop)
    assert budget.limit_metric == pytest.approx(baseline - allowed if higher else baseline + allowed)
    assert budget.metric_after(budget.drop(metric)) == pytest.approx(metric)
    assert not budget.meets(math.nan) and not budget.meets(None)
    assert hash(budget) == hash(Budget(baseline, allowed, higher_is_better=higher))


def test_a_relative_budget_of_a_lower_is_better_metric_is_a_fraction_of_its_value():
    assert _checks.allowed_worsening(23.43, 0.02, True, higher_is_better=False) == pytest.approx(0.4686)
    assert _checks.allowed_worsening(23.43, 0.5, False, higher_is_better=False) == 0.5
    assert _checks.allowed_worsening(-2.0, 0.1, True, higher_is_better=True) == pytest.approx(0.2)  # as before
    _checks.check_budget(1.5, relative=True, higher_is_better=False)  # perplexity up to 2.5x: accepted
    with pytest.raises(ValueError, match=r"max_drop=1.5 \(150%\)"):
        _checks.check_budget(1.5, relative=True, higher_is_better=True)


@pytest.mark.parametrize("value", [0.0, -23.4])
def test_a_relative_budget_refuses_a_non_positive_lower_is_better_baseline(value):
    with pytest.raises(ValueError, match=rf"must be > 0. Received: eval_fn\(float32 model\)={value!r} with "
                                         r"max_drop=0.02, relative=True, higher_is_better=False"):
        search.tune(TwoMatmuls(PARAMS), lambda m: value, X, candidates=["float32", "bfloat16"], max_drop=0.02,
                    higher_is_better=False, adapter=TwoMatmulsAdapter, **QUICK)


def test_an_absolute_budget_takes_a_negative_lower_is_better_baseline():
    # A log-likelihood's negative is a loss that may be below zero: absolute budgets need no sign.
    result = search.tune(TwoMatmuls(PARAMS), lambda m: loss(m) - 5.0, X, candidates=["float32", "bfloat16"],
                         max_drop=0.1, relative=False, higher_is_better=False, adapter=SlowFloat32Adapter, **QUICK)
    assert result.budget.baseline_metric == pytest.approx(-4.0, abs=1e-6)
    assert result.summary["budget"]["max_metric"] == pytest.approx(-3.9, abs=1e-6)
    assert result.policy_map["w1"].name == "float32"


@pytest.mark.parametrize("bad, error, message", [
    (dict(eval_fn=lambda m: math.nan), ValueError, "nan"),
    (dict(higher_is_better="lower"), TypeError, "higher_is_better='lower'"),
    (dict(higher_is_better=None), TypeError, "higher_is_better=None"),
])
def test_bad_direction_arguments_and_a_nan_baseline_are_named(bad, error, message):
    options = dict(eval_fn=loss, candidates=["float32", "bfloat16"], max_drop=0.02, higher_is_better=False,
                   adapter=TwoMatmulsAdapter, **QUICK)
    options.update(bad)
    with pytest.raises(error, match=message):
        search.tune(TwoMatmuls(PARAMS), sample_input=X, **options)


def test_experiment_states_the_direction_and_refuses_a_non_bool():
    exp = Experiment(name="e", model=object(), eval_fn=loss, sample_input=X, higher_is_better=False)
    assert exp.higher_is_better is False
    assert Experiment(name="e", model=object(), eval_fn=loss, sample_input=X).higher_is_better is True
    with pytest.raises(TypeError, match="Experiment.higher_is_better must be True .* Received: higher_is_better=0"):
        Experiment(name="e", model=object(), eval_fn=loss, sample_input=X, higher_is_better=0)


# --- end to end: a loss (lower is better) --------------------------------------------------------

@pytest.fixture(scope="module")
def loss_run():
    # float32 is slow (SlowFloat32Adapter), so bfloat16 everywhere is the fastest assignment; its
    # loss rises by 0.5 (w1) and breaks the 10% budget: w1 must stay float32.
    return search.tune(TwoMatmuls(PARAMS), loss, X, candidates=["float32", "mixed_bfloat16"], max_drop=0.1,
                       higher_is_better=False, adapter=SlowFloat32Adapter, profile_accuracy="always", **QUICK)


def test_a_candidate_raising_the_loss_beyond_the_budget_is_rejected(loss_run):
    baseline = loss_run.budget.baseline_metric
    assert baseline == pytest.approx(1.0, abs=1e-6) and loss_run.budget.higher_is_better is False
    assert loss_run.budget.allowed_drop == pytest.approx(0.1 * baseline)
    w1, w2 = loss_run.accuracy.get("w1", "mixed_bfloat16"), loss_run.accuracy.get("w2", "mixed_bfloat16")
    assert w1.cost == pytest.approx(w1.metric - baseline) and w1.cost > 0.49  # a rise is a cost
    assert w2.metric < baseline and w2.cost == 0.0  # a loss that falls costs nothing
    assert loss_run.policy_map["w1"].name == "float32"
    assert loss_run.chosen.meets_budget and loss_run.chosen.metric <= baseline * 1.1
    by_name = {c.name: c for c in loss_run.configurations}
    uniform = by_name["uniform mixed_bfloat16"]
    assert uniform.metric > baseline * 1.1 and uniform.meets_budget is False
    for c in loss_run.configurations:  # every verdict is read upwards
        if c.metric is not None and math.isfinite(c.metric) and not c.disqualified:
            assert c.meets_budget == (c.metric <= baseline * 1.1 + 1e-12), c.name


def test_the_summary_states_the_direction_and_the_allowed_rise(loss_run):
    s = loss_run.summary
    budget = s["budget"]
    assert budget["higher_is_better"] is False and budget["relative"] is True and budget["max_drop"] == 0.1
    assert budget["max_metric"] == pytest.approx(budget["baseline_metric"] * 1.1) == budget["limit_metric"]
    assert "min_metric" not in budget
    assert s["chosen"]["drop"] == pytest.approx(s["chosen"]["metric"] - budget["baseline_metric"])  # the rise
    assert s["uniform"]["mixed_bfloat16"]["drop"] > 0.4  # 0.5 - 0.05, and the rounding
    predicted = loss_run.frontier[loss_run.frontier["source"] == "predicted"]
    np.testing.assert_allclose(predicted["predicted_metric"],
                               budget["baseline_metric"] + predicted["predicted_accuracy_cost"])
    measured = loss_run.frontier[loss_run.frontier["source"] == "measured"]
    metrics = list(measured.sort_values("measured_latency_s")["metric"])
    assert metrics == sorted(metrics, reverse=True)  # slower points on the frontier have lower losses


def test_the_report_says_rise_and_maximum(loss_run, tmp_path):
    loss_run.save(str(tmp_path))
    text = report_markdown(str(tmp_path))
    assert "Allowed rise" in text and "10% of float32" in text and "Maximum metric" in text
    assert "(lower is better)" in text and "Allowed drop" not in text
    assert "| rise |" in text.replace("  ", " ")


# --- the memory budget: a hard constraint ---------------------------------------------------------

class SlowBfloat16Adapter(TwoMatmulsAdapter):
    """bfloat16 sleeps 3 ms per matmul where float32 runs at once, alone and in the model: float32
    is faster everywhere, and accurate (the metric is float32's own)."""

    def layer_program(self, path, policy):
        if policy.compute_dtype == "float32":
            return super().layer_program(path, policy)
        return Program(_slow, (self.inputs[path].astype(policy.compute_dtype),), self.model.params[path])

    def model_program(self, model):
        def run(params, x):
            for path, dtype in zip(self.PATHS, model.dtypes):
                x = (_matmul if dtype == "float32" else _slow)(params[path], x.astype(dtype))
            return x.astype(jnp.float32)

        return Program(run, (self.inputs["w1"],), model.params)


SLOW_SECONDS = 3e-3


def _slow_matmul(seconds: float):
    """``x @ w`` after a host sleep of ``seconds``: a sleep, not arithmetic, so the gap between one
    slow layer and two does not shrink when other processes load the cores, and the end-to-end
    rounds always tell the maps apart."""

    def sleep(x):
        time.sleep(seconds)
        return np.asarray(x)

    def slow(w, x):
        x = jax.pure_callback(sleep, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return x @ w.astype(x.dtype)

    return slow


_slow = _slow_matmul(SLOW_SECONDS)


@pytest.mark.slow
@pytest.mark.parametrize("higher_is_better", [True, False])
def test_a_memory_budget_forces_a_slower_policy_on_exactly_the_layer_it_must(higher_is_better):
    # float32 takes 4 (W1 + W2) bytes; bfloat16 on w2 alone (4 W1 + 2 W2) is over the budget, on
    # w1 alone (2 W1 + 4 W2) it fits: the fastest map within it changes w1 and nothing else.
    budget = 2 * W1 + 4 * W2
    metric = (lambda m: 1.0) if higher_is_better else (lambda m: 2.0)
    # float32 cannot be chosen (over the budget), so the incumbent is the faster median of the map
    # and uniform bfloat16: 10 repeats time the map in steps of 5 rounds (3 repeats: 3 rounds in
    # all), so that a machine loaded by the other tests cannot flip that median (one CI run chose
    # uniform bfloat16 so).
    result = search.tune(TwoMatmuls(PARAMS), metric, X, candidates=["float32", "bfloat16"], max_drop=0.01,
                         memory_budget=budget, higher_is_better=higher_is_better, adapter=SlowBfloat16Adapter,
                         **{**QUICK, "repeats": 10})
    assert result.chosen.changed == {"w1": "bfloat16"}
    assert result.chosen.nbytes == budget and result.chosen.meets_budget
    memory = result.summary["memory"]
    assert memory == {"budget": budget, "chosen_nbytes": budget, "float32_nbytes": 4 * (W1 + W2),
                      "least_nbytes": 2 * (W1 + W2)}
    assert result.summary["float32"]["excluded"].startswith("over the memory budget")


_slow_1ms = _slow_matmul(1e-3)
_slow_10ms = _slow_matmul(10e-3)


class FasterBfloat16OnW1Adapter(SlowBfloat16Adapter):
    """bfloat16 on w1 sleeps 1 ms, on w2 10 ms: both slower than float32, w1 by far the less so
    (a sleeping callback woken on a loaded core can wait a few milliseconds for it: with 1 and 3 ms
    the layer timings once put w2 first, with two test workers compiling beside them)."""

    def layer_program(self, path, policy):
        if policy.compute_dtype == "float32":
            return super().layer_program(path, policy)
        slow = _slow_1ms if path == "w1" else _slow_10ms
        return Program(slow, (self.inputs[path].astype(policy.compute_dtype),), self.model.params[path])

    def model_program(self, model):
        def run(params, x):
            for path, dtype in zip(self.PATHS, model.dtypes):
                fn = _matmul if dtype == "float32" else (_slow_1ms if path == "w1" else _slow_10ms)
                x = fn(params[path], x.astype(dtype))
            return x.astype(jnp.float32)

        return Program(run, (self.inputs["w1"],), model.params)


def test_under_a_memory_budget_a_slower_but_smaller_candidate_is_scored_and_chosen():
    # Either layer alone in bfloat16 fits the budget. The fastest such map (w1, the less slow)
    # breaks the loss budget, so the layers are scored: bfloat16 is slower than float32 on both,
    # yet smaller, so it is scored (it used to be skipped as "slower than float32", leaving the
    # solver nothing that fits), and w2 in bfloat16 is the map.
    budget = 4 * W1 + 2 * W2
    result = search.tune(TwoMatmuls(PARAMS), loss, X, candidates=["float32", "bfloat16"], max_drop=0.1,
                         higher_is_better=False, memory_budget=budget, adapter=FasterBfloat16OnW1Adapter,
                         profile_accuracy="measure", **QUICK)
    assert result.summary["maps"][0]["meets_budget"] is False
    assert result.accuracy.get("w1", "bfloat16").cost > 0.49 and result.accuracy.get("w2", "bfloat16").cost == 0.0
    assert result.chosen.changed == {"w2": "bfloat16"} and result.chosen.meets_budget
    assert result.chosen.nbytes == budget


@pytest.mark.slow
def test_the_memory_budget_binds_with_the_accuracy_budget():
    # bfloat16 on w1 would fit the memory but breaks the loss budget: no map within both exists
    # once w2 alone cannot make the bytes, so the tune says so.
    with pytest.raises(ValueError, match="No configuration can be chosen: float32 is over the memory budget") as e:
        search.tune(TwoMatmuls(PARAMS), loss, X, candidates=["float32", "mixed_bfloat16", "bfloat16"],
                    max_drop=0.1, higher_is_better=False, memory_budget=2 * W1 + 4 * W2,
                    adapter=SlowBfloat16Adapter, **QUICK)
    # ... and names how far off the budgets the nearest evaluated configurations were.
    message = str(e.value)
    assert (f"Closest evaluated (metric limit 1.1, memory budget {2 * W1 + 4 * W2:,} bytes): uniform bfloat16: "
            f"metric 1.45") in message
    assert f", {2 * (W1 + W2):,} bytes (over the accuracy budget)" in message
    assert message.endswith("Allow a larger max_drop or memory budget.")


def test_a_memory_budget_below_the_all_lowest_model_names_the_least_bytes():
    least = 2 * (W1 + W2)
    with pytest.raises(ValueError, match=rf"memory_budget={least - 1} cannot be met: the tuned layers' weights "
                                         rf"take at least {least:,} bytes with these candidates"):
        search.tune(TwoMatmuls(PARAMS), loss, X, candidates=["float32", "bfloat16"], memory_budget=least - 1,
                    higher_is_better=False, adapter=TwoMatmulsAdapter, **QUICK)


# --- the command line -----------------------------------------------------------------------------

LOSS_EXPERIMENT = '''
import jax, jax.numpy as jnp, numpy as np
from autopolicy import nn
from autopolicy.experiment import Experiment

def build(cache_dir):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 16)), jnp.float32)
    model = nn.Sequential([nn.Dense(32, activation="relu"), nn.Dense(4)], name="tiny").build(jax.random.key(0), x)
    reference = model(x)

    def loss(m):  # 1 + the mean absolute error: lower is better, positive
        return 1.0 + float(jnp.mean(jnp.abs(m(x).astype(jnp.float32) - reference)))

    return Experiment(name="tinyloss", model=model, eval_fn=loss, sample_input=x, metric_name="loss",
                      candidates=("float32", "int8_from_float32"), max_drop=0.05, higher_is_better=False)
'''


def test_the_cli_tunes_a_lower_is_better_experiment_and_prints_the_allowed_rise(tmp_path, capsys):
    path = tmp_path / "tinyloss.py"
    path.write_text(LOSS_EXPERIMENT)
    out = tmp_path / "run"
    assert cli.main(["tune", str(path), "--out", str(out), "--repeats", "3", "--no-progress", "--no-report",
                     "--max-drop", "150%", "--memory-budget", "100000"]) == 0
    printed = capsys.readouterr().out
    assert "float32 loss: 1.0000 (lower is better); allowed rise 150% (1.5): at most 2.5000" in printed
    assert "drop" not in printed.split("device:")[1]
    assert "memory budget 100,000" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["budget"]["higher_is_better"] is False and summary["budget"]["max_metric"] == pytest.approx(2.5)


@pytest.mark.parametrize("argv, higher", [([], None), (["--lower-is-better"], False), (["--higher-is-better"], True)])
def test_the_direction_flags(argv, higher):
    assert cli.build_parser().parse_args(["tune", *argv]).higher_is_better is higher


def test_the_direction_flags_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["tune", "--lower-is-better", "--higher-is-better"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_percentage_over_100_is_a_slip_only_when_higher_is_better():
    cli._check_percentage(cli._fraction("150%"), higher_is_better=False)
    with pytest.raises(cli.UsageError, match="'150%' is over 100%"):
        cli._check_percentage(cli._fraction("150%"), higher_is_better=True)
