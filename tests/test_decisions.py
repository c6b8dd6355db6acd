"""Decisions that survive noise: paired speed-ups with intervals, the decision rule, the
calibrated latency model and the noise verdict, on synthetic timings (no machine timing); then
what can never be chosen, end to end on tiny models: a configuration over the memory budget, or
one that fails to build, run or be scored."""

import dataclasses
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy.nn as nn
from autopolicy import policies, search
from autopolicy.search import confidence, latency_model, noise, verify
from autopolicy.search.adapter import Program, TunableLayer, get_adapter
from autopolicy.search.phases import Configuration, LatencyProfile, LayerTiming, Site, Status
from tests.test_adapter import PARAMS, X, TwoMatmuls, TwoMatmulsAdapter, _matmul, fidelity
from tests.test_exclusions import W1, W2, FailingAdapter

RNG = np.random.default_rng(0)


def _noisy(seconds, cv, n, rng):
    return list(seconds * (1 + cv * rng.standard_normal(n)))


def test_a_clear_speedup_has_an_interval_above_the_margin():
    rng = np.random.default_rng(1)
    ref, fast = _noisy(2.0, 0.02, 40, rng), _noisy(1.0, 0.02, 40, rng)
    s = confidence.paired_speedup(ref, fast)
    assert s.median == pytest.approx(2.0, rel=0.02)
    assert 1.9 < s.low < s.median < s.high < 2.1 and s.rounds == 40
    assert s.clears(1.02) and not s.straddles(1.02)


def test_a_change_inside_the_noise_straddles_the_margin():
    rng = np.random.default_rng(2)
    ref, same = _noisy(1.0, 0.2, 20, rng), _noisy(0.99, 0.2, 20, rng)
    s = confidence.paired_speedup(ref, same)
    assert s.low < 1.02 <= s.high and not s.clears(1.02)


def test_pairing_cancels_drift_that_hits_both():
    drift = np.linspace(1.0, 3.0, 30)  # the machine slows down threefold during the run
    s = confidence.paired_speedup(list(1.5 * drift), list(1.0 * drift))
    assert s.median == pytest.approx(1.5) and s.low == pytest.approx(1.5) and s.high == pytest.approx(1.5)


def test_the_interval_is_reproducible():
    ref, cand = _noisy(1.2, 0.1, 15, np.random.default_rng(3)), _noisy(1.0, 0.1, 15, np.random.default_rng(4))
    assert confidence.paired_speedup(ref, cand) == confidence.paired_speedup(ref, cand)


@pytest.mark.parametrize("ref,cand,text", [([1.0, 1.0], [1.0, 1.0], "lengths 2 and 2"),
                                           ([1.0] * 4, [1.0] * 3, "lengths 4 and 3")])
def test_paired_speedup_needs_equal_series_of_three_rounds(ref, cand, text):
    with pytest.raises(ValueError, match=text):
        confidence.paired_speedup(ref, cand)


class FakeEndToEnd:
    """Paired rounds from fixed per-configuration seconds and noise, with optional extra rounds."""

    def __init__(self, seconds, cv, rounds, seed=0, cached=False):
        self.seconds, self.cv, self.rng = seconds, cv, np.random.default_rng(seed)
        self.samples_ = {k: [] for k in seconds}
        self.extra_seconds, self.cached = 0.0, cached
        self._time(list(seconds), rounds)

    def _time(self, names, rounds):
        for _ in range(rounds):
            common = 1 + 0.5 * self.rng.random()  # drift shared by the round
            for k in names:
                self.samples_[k].append(self.seconds[k] * common * (1 + self.cv * self.rng.standard_normal()))

    def more(self, configs, rounds):
        if self.cached:
            return False
        self.extra_seconds += 1.0
        names = [c.name for c in configs]
        # Keep the pair aligned: the others get no sample, so compare over common rounds.
        self._time(names, rounds)
        for k in self.samples_:
            if k not in names:
                self.samples_[k].append(math.nan)
        return True

    def speedup(self, candidate, reference):
        pairs = [(r, c) for r, c in zip(self.samples_[reference.name], self.samples_[candidate.name])
                 if r == r and c == c]
        return confidence.paired_speedup([p[0] for p in pairs], [p[1] for p in pairs])


def _config(name, kind, seconds):
    return Configuration(name, kind, {}, policies.DTypePolicyMap("float32", {name.replace(" ", "_"): "bfloat16"}
                                                                if kind != "uniform" or "float32" not in name else {}),
                         seconds, uniform=name.split()[-1] if kind == "uniform" else None, measured_latency_s=seconds)


class Ctx:
    min_speedup, confirm_seconds, repeats = 1.02, 5.0, 10
    budget = SimpleNamespace(drop=lambda metric: metric)  # the metric is the budget spent


def _decide(seconds, cv=0.02, rounds=20, cached=False):
    configs = {name: _config(name, "uniform" if name.startswith("uniform") else "map", s) for name, s in seconds.items()}
    e2e = FakeEndToEnd(seconds, cv, rounds, cached=cached)
    float32 = configs.pop("uniform float32")
    winner, log = verify.decide(Ctx, e2e, float32, list(configs.values()))
    return winner, log, e2e


def test_a_map_that_is_clearly_faster_than_the_best_uniform_policy_wins():
    winner, log, _ = _decide({"uniform float32": 10.0, "uniform int8": 6.0, "map (round 1)": 5.0})
    assert winner.name == "map (round 1)"
    assert log[0].startswith("uniform int8 replaces uniform float32") and "map (round 1) replaces uniform int8" in log[1]


def test_a_map_within_noise_of_the_uniform_policy_leaves_the_simpler_one():
    winner, log, e2e = _decide({"uniform float32": 10.0, "uniform int8": 6.0, "map (round 1)": 5.95}, cv=0.03)
    assert winner.name == "uniform int8"
    assert "map (round 1) does not replace uniform int8" in log[-1]
    assert e2e.extra_seconds == 0  # clearly below the margin: no extra rounds needed


def test_a_close_call_takes_extra_rounds_up_to_the_budget_then_the_simpler_stays():
    winner, log, e2e = _decide({"uniform float32": 10.0, "uniform int8": 6.0, "map (round 1)": 6.0 / 1.02}, cv=0.05)
    assert winner.name == "uniform int8" and "does not replace uniform int8" in log[-1]
    assert e2e.extra_seconds == Ctx.confirm_seconds  # one second per extra batch in the fake
    assert "over 150 rounds" in log[-1]  # 20, then 5 batches of half the rounds so far: 10, 15, 22, 33, 50


def test_nothing_faster_by_the_margin_keeps_float32():
    winner, log, _ = _decide({"uniform float32": 10.0, "uniform bfloat16": 9.95, "map (round 1)": 9.9})
    assert winner.name == "uniform float32" and all("does not replace" in line for line in log)


def test_a_cached_decision_takes_no_extra_rounds():
    _, _, e2e = _decide({"uniform float32": 10.0, "uniform int8": 9.9}, cv=0.05, cached=True)
    assert e2e.extra_seconds == 0.0


def _profile(assign_seconds):
    """Two chained layers with isolated latencies per policy, and a cast cost."""
    layers = [TunableLayer(p, "Dense", ("int8",), f"sig{p}", (8, 4), None if i == 0 else "a")
              for i, p in enumerate(("a", "b"))]
    cands = (policies.get("float32"), policies.get("int8_from_float32"))
    sites = tuple(Site(i, l, i == 1, cands) for i, l in enumerate(layers))
    timings = {p: {n: LayerTiming(s, s, s, 0.01, 5, 1, True, 100) for n, s in table.items()}
               for p, table in assign_seconds.items()}
    return LatencyProfile(sites, timings, {})


def test_the_latency_model_fits_each_policy_from_the_uniform_timings():
    latency = _profile({"a": {"float32": 1.0, "int8_from_float32": 0.5},
                        "b": {"float32": 3.0, "int8_from_float32": 1.0}})
    all32 = {"a": "float32", "b": "float32"}
    all8 = {"a": "int8_from_float32", "b": "int8_from_float32"}
    # End to end: float32 takes 2 s (isolated timings overstate it 2x), int8 3 s (understated).
    fitted = latency_model.fit(latency, [(all32, 2.0), (all8, 3.0)])
    assert fitted.scale["float32"] == pytest.approx(0.5) and fitted.scale["int8_from_float32"] == pytest.approx(2.0)
    assert fitted.predict(latency, all32) == pytest.approx(2.0)
    assert fitted.predict(latency, {"a": "int8_from_float32", "b": "float32"}) == pytest.approx(0.5 * 3 + 2 * 0.5)
    assert latency_model.IDENTITY.predict(latency, all8) == pytest.approx(1.5)


def test_the_latency_model_keeps_positive_scales():
    latency = _profile({"a": {"float32": 1.0, "int8_from_float32": 0.5}, "b": {"float32": 1.0, "int8_from_float32": 0.5}})
    fitted = latency_model.fit(latency, [({}, 2.0), ({"a": "int8_from_float32", "b": "int8_from_float32"}, -1.0)])
    assert fitted.scale == {"float32": 1.0} and fitted.factor("int8_from_float32") == 1.0


def _streamed(bandwidth):
    """A decoder's shape of problem: a small layer ``a`` (1 MB of float32) that ran from the L2
    cache when timed alone, a large layer ``b`` (16 MB) whose isolated timing already streamed,
    and an embedding ``e`` (64 MB, reads one row a call). int8 stores a quarter of the bytes."""
    mb = 1 << 20
    spec = {"e": (True, {"float32": (2e-6, 64 * mb)}),
            "a": (False, {"float32": (20e-6, mb), "int8_from_float32": (12e-6, mb // 4)}),
            "b": (False, {"float32": (900e-6, 16 * mb), "int8_from_float32": (210e-6, 4 * mb)})}
    cands = (policies.get("float32"), policies.get("int8_from_float32"))
    sites = tuple(Site(i, TunableLayer(p, "Dense", ("int8",), f"sig{p}", (1, 8), None, gather=gather),
                       False, cands[:len(table)]) for i, (p, (gather, table)) in enumerate(spec.items()))
    timings = {p: {n: LayerTiming(s, s, s, 0.01, 5, 1, True, b) for n, (s, b) in table.items()}
               for p, (_, table) in spec.items()}
    return LatencyProfile(sites, timings, {}, bandwidth)


def test_a_layer_in_a_model_larger_than_the_cache_takes_at_least_its_bytes_over_the_bandwidth():
    floored, alone = _streamed(20e9), _streamed(None)
    a, b, e = floored.sites[1], floored.sites[2], floored.sites[0]
    assert floored.latency_s(a, "float32") == pytest.approx((1 << 20) / 20e9)  # 52 us, not the 20 us timed alone
    assert floored.latency_s(a, "int8_from_float32") == pytest.approx(13.1072e-6)  # 262144 B / 20 GB/s > 12 us
    assert floored.latency_s(b, "float32") == pytest.approx(900e-6)  # slower than its 839 us floor: its own time
    assert floored.latency_s(e, "float32") == pytest.approx(2e-6)  # a gather reads one row, not 64 MB
    assert alone.latency_s(a, "float32") == pytest.approx(20e-6)
    assert floored.predicted_latency({}) == pytest.approx(2e-6 + (1 << 20) / 20e9 + 900e-6)


def test_the_streaming_floor_lets_one_scale_per_policy_predict_a_mixed_map():
    # End to end the small layers stream at 20 GB/s: float32 takes e + 52 + 900 us, int8 e + 13 + 210 us.
    mb, bw = 1 << 20, 20e9
    e2e = {"a": {"float32": mb / bw, "int8_from_float32": (mb // 4) / bw},
           "b": {"float32": 900e-6, "int8_from_float32": 210e-6}}
    uniform32, uniform8 = {}, {"a": "int8_from_float32", "b": "int8_from_float32"}
    mixed = {"a": "float32", "b": "int8_from_float32"}  # a small float32 layer in an int8 model

    def seconds(assignment):
        return 2e-6 + sum(e2e[p][assignment.get(p, "float32")] for p in "ab")

    timed = [(uniform32, seconds(uniform32)), (uniform8, seconds(uniform8))]
    floored, alone = _streamed(bw), _streamed(None)
    with_floor = latency_model.fit(floored, timed).predict(floored, mixed)
    without = latency_model.fit(alone, timed).predict(alone, mixed)
    assert with_floor == pytest.approx(seconds(mixed), rel=0.01)
    assert without < 0.9 * seconds(mixed)  # the isolated 20 us understates the float32 layer


class _E2E:
    cpu_per_wall, extra_seconds = 1.0, 0.0


def test_noise_says_busy_when_the_timings_spread(monkeypatch):
    monkeypatch.setattr(noise, "machine_load", lambda: {"load_1m": 1.0, "cores": 2.0})
    quiet = _profile({"a": {"float32": 1.0, "int8_from_float32": 0.5}, "b": {"float32": 1.0, "int8_from_float32": 0.5}})
    assert noise.assess(quiet, _E2E)["busy"] is False and noise.assess(quiet, _E2E)["note"] == "quiet"
    noisy = LatencyProfile(quiet.sites, {p: {n: LayerTiming(1.0, 0.7, 1.3, 0.4, 5, 1, True, 1) for n in t}
                                         for p, t in quiet.timings.items()}, {})
    verdict = noise.assess(noisy, _E2E)
    assert verdict["busy"] is True and "median layer timing CV 0.40 > 0.1" in verdict["note"]
    monkeypatch.setattr(noise, "machine_load", lambda: {"load_1m": 4.5, "cores": 2.0})
    assert "load average 4.5 on 2 cores" in noise.assess(quiet, _E2E)["note"]


# End to end on tiny models: what can never be chosen.

QUICK = dict(repeats=3, progress=False, confirm_seconds=0)


def _mlp():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 64)), jnp.float32)
    model = nn.Sequential([nn.Dense(128, activation="relu", name="a"), nn.Dense(128, activation="relu", name="b"),
                           nn.Dense(4, name="c")], name="m").build(jax.random.key(0), x)
    reference = np.asarray(model(x))
    return model, x, lambda m: 1.0 - float(np.linalg.norm(np.asarray(m(x)) - reference) / np.linalg.norm(reference))


@pytest.mark.slow  # a full tune with timing: 16 s on two shared cores
def test_a_memory_budget_that_int8_on_some_layers_meets_disqualifies_uniform_float32():
    model, x, score = _mlp()
    made = get_adapter(model, (x,), [(x,)])
    nbytes = {(p, n): made.layer_bytes(p, policies.get(n)) for p in ("m/a", "m/b", "m/c")
              for n in ("float32", "int8_from_float32")}
    float32_bytes = sum(nbytes[p, "float32"] for p in ("m/a", "m/b", "m/c"))
    # int8 on m/b alone fits; int8 on m/a alone does not, nor does float32 everywhere.
    budget = nbytes["m/a", "float32"] + nbytes["m/b", "int8_from_float32"] + nbytes["m/c", "float32"] + 1000
    assert nbytes["m/a", "int8_from_float32"] + nbytes["m/b", "float32"] + nbytes["m/c", "float32"] > budget
    result = search.tune(model, score, x, candidates=["float32", "int8_from_float32"], max_drop=0.1,
                         memory_budget=budget, **QUICK)
    by_name = {c.name: c for c in result.configurations}
    float32 = by_name["uniform float32"]
    assert float32.nbytes == float32_bytes > budget
    assert float32.excluded == f"over the memory budget: {float32_bytes:,} bytes > {budget:,}"
    assert result.summary["float32"]["excluded"] == float32.excluded
    assert result.chosen.excluded == "" and result.chosen.nbytes <= budget
    assert result.summary["chosen"]["nbytes"] <= budget
    assert result.policy_map["m/b"].name == "int8_from_float32"
    for c in result.configurations:  # every configuration over the budget is excluded as such
        assert (c.nbytes > budget) == c.excluded.startswith("over the memory budget"), c.name


def test_a_cached_decision_is_not_reused_under_a_memory_budget_that_excludes_its_winner(tmp_path, monkeypatch):
    # The same configurations timed in both runs (no map: the fastest assignment is taken as
    # settled), so the second run finds the first one's rounds and decision in the cache.
    monkeypatch.setattr(verify, "fastest_first", lambda *args, **kwargs: ([], True))
    options = dict(candidates=["float32", "bfloat16"], max_drop=0.5, relative=False, min_speedup=1000.0,
                   adapter=TwoMatmulsAdapter, cache_dir=str(tmp_path), **QUICK)
    first = search.tune(TwoMatmuls(PARAMS), fidelity, X, **options)
    assert first.chosen.name == "uniform float32"  # nothing is 1000x faster
    budget = 3 * W1 + 4 * W2  # float32 does not fit; bfloat16 weights do
    second = search.tune(TwoMatmuls(PARAMS), fidelity, X, memory_budget=budget, **options)
    assert second.chosen.name == "uniform bfloat16" and second.chosen.nbytes <= budget
    assert second.decisions[0].startswith("uniform float32 cannot be chosen (over the memory budget")


def test_a_rerun_decides_on_the_same_group_rounds_and_adds_the_extra_rounds_kept_with_the_decision(
        tmp_path, monkeypatch):
    """Extra rounds taken for a close call are cached with the decision, not with the group: a
    rerun reads the very rounds the first run read before deciding (which uniform policies it
    scores depends on them), then adds the extra ones, and reports the same figures."""
    import json  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(verify, "fastest_first", lambda *args, **kwargs: ([], True))
    real = verify._challenge

    def close_call(ctx, e2e, challenger, incumbent):
        e2e.more([challenger, incumbent], 3)  # taken only when nothing came from the cache
        return real(ctx, e2e, challenger, incumbent)

    monkeypatch.setattr(verify, "_challenge", close_call)
    options = dict(candidates=["float32", "bfloat16"], max_drop=0.5, relative=False, min_speedup=1000.0,
                   adapter=TwoMatmulsAdapter, cache_dir=str(tmp_path), **QUICK)
    first = search.tune(TwoMatmuls(PARAMS), fidelity, X, **options)
    entries = json.loads((tmp_path / "measurements.json").read_text())
    kept = [v for v in entries.values() if isinstance(v, dict) and "extra_rounds" in v]
    assert len(kept) == 1 and len(kept[0]["extra_rounds"]) == 3
    second = search.tune(TwoMatmuls(PARAMS), fidelity, X, **options)
    assert second.chosen.name == first.chosen.name and second.decisions == first.decisions
    for a, b in zip(first.configurations, second.configurations):
        assert (a.name, a.rounds, a.measured_latency_s, a.speedup_low) == (b.name, b.rounds, b.measured_latency_s,
                                                                          b.speedup_low)
    groups = [v["rounds"] for v in entries.values() if isinstance(v, dict) and "rounds" in v]
    float32 = next(c for c in first.configurations if c.name == "uniform float32")
    assert sum(len(g) for g in groups) + 3 == float32.rounds  # calibration + final rounds, then the 3 extra


def _slow_matmul(w, x):
    y = jax.lax.fori_loop(0, 40, lambda _, y: (y @ w) @ w.T / 8, x)
    return y @ w


class SlowFloat32Adapter(TwoMatmulsAdapter):
    """Each layer runs 81 matmuls in float32 and one in bfloat16, alone and in the model (the
    latency model fitted end to end agrees): the fastest assignment, verified first, is
    bfloat16 everywhere."""

    def layer_program(self, path, policy):
        if policy.compute_dtype != "float32":
            return super().layer_program(path, policy)
        return Program(_slow_matmul, (self.inputs[path],), self.model.params[path])

    def model_program(self, model):
        def run(params, x):
            for path, dtype in zip(self.PATHS, model.dtypes):
                x = (_slow_matmul if dtype == "float32" else _matmul)(params[path], x.astype(dtype))
            return x.astype(jnp.float32)

        return Program(run, (self.inputs["w1"],), model.params)


def _fails_on_bfloat16(model):
    if "bfloat16" in model.dtypes:
        raise RuntimeError("no bfloat16 on this device")
    return fidelity(model)


@pytest.mark.parametrize("profile_accuracy", ["auto", "always"])
def test_an_eval_fn_that_raises_excludes_the_configuration_and_the_tune_goes_on(profile_accuracy):
    result = search.tune(TwoMatmuls(PARAMS), _fails_on_bfloat16, X, candidates=["float32", "mixed_bfloat16"],
                         max_drop=0.5, relative=False, adapter=SlowFloat32Adapter, profile_accuracy=profile_accuracy,
                         **QUICK)
    failure = "RuntimeError: no bfloat16 on this device"
    assert result.chosen.changed == {} and result.model.dtypes == ("float32", "float32")
    rows = result.profile[result.profile["policy"] == "mixed_bfloat16"]
    assert list(rows["status"]) == [f"{Status.FAILED} ({failure})"] * 2
    assert result.accuracy.get("w1", "mixed_bfloat16").usable is False
    every_bfloat16 = [c for c in result.configurations if "mixed_bfloat16" in c.assignment.values()]
    assert every_bfloat16 and all(c.excluded in ("", f"failed to evaluate: {failure}") for c in every_bfloat16)
    if profile_accuracy == "auto":  # verified first, as the fastest assignment
        fastest = next(m for m in result.summary["maps"] if m["round"] == 1)
        assert fastest["excluded"] == f"failed to evaluate: {failure}" and fastest["meets_budget"] is False


def test_a_layer_that_fails_to_build_is_disqualified_in_the_sensitivity_table():
    result = search.tune(TwoMatmuls(PARAMS), fidelity, X, candidates=["float32", "mixed_float16"], max_drop=0.5,
                         relative=False, adapter=FailingAdapter, profile_accuracy="always", **QUICK)
    rows = result.profile[result.profile["policy"] == "mixed_float16"]
    failure = "NotImplementedError: no float16 kernel on this backend"
    assert list(rows["status"]) == [f"{Status.FAILED} ({failure})"] * 2
    assert result.summary["uniform"]["mixed_float16"]["excluded"] == f"failed to build: {failure}"
    assert result.chosen.changed == {}


def test_a_float32_model_that_fails_to_run_is_a_value_error():
    class Broken(TwoMatmulsAdapter):
        def model_program(self, model):
            raise RuntimeError("cannot lower the model")

    with pytest.raises(ValueError, match="The float32 model failed to build or run: RuntimeError: cannot lower"):
        search.tune(TwoMatmuls(PARAMS), fidelity, X, candidates=["float32"], adapter=Broken, **QUICK)


class SteppedEndToEnd(FakeEndToEnd):
    """FakeEndToEnd with what verify.unsettled reads (failures, samples, rounds shared)."""

    def failure(self, config):
        return ""

    def samples(self, config):
        return self.samples_[config.name]

    def rounds_together(self, configs):
        return sum(1 for values in zip(*(self.samples_[c.name] for c in configs)) if all(v == v for v in values))


def test_nothing_is_unsettled_once_no_interval_straddles_the_margin():
    float32, slow, fast = (_config("uniform float32", "uniform", 10.0), _config("uniform int8", "uniform", 12.0),
                           _config("map (round 1)", "map", 6.0))
    e2e = SteppedEndToEnd({"uniform float32": 10.0, "uniform int8": 12.0, "map (round 1)": 6.0}, 0.02, 10)
    assert verify.unsettled(Ctx, e2e, float32, [slow, fast]) == []  # 0.83x and 1.67x: both clear of 1.02
    close = _config("map (round 2)", "map", 9.85)  # 1.015x: within noise of the margin
    e2e = SteppedEndToEnd({"uniform float32": 10.0, "map (round 2)": 9.85}, 0.03, 10)
    assert verify.unsettled(Ctx, e2e, float32, [close]) == [float32, close]
    e2e = SteppedEndToEnd({"uniform float32": 10.0, "uniform int8": 12.0}, 0.02, 2)
    assert verify.unsettled(Ctx, e2e, float32, [slow]) == [float32, slow]  # 2 rounds: too few for an interval


def test_stopping_final_rounds_early_does_not_let_an_equal_configuration_win():
    # Sequential looks (every 5 rounds, up to 40) at a configuration exactly as fast as
    # float32: it must not replace float32 more often than the interval's own error rate.
    wins = 0
    for seed in range(30):
        e2e = SteppedEndToEnd({"uniform float32": 10.0, "uniform bf16": 10.0}, 0.05, 20, seed=seed)
        float32, same = _config("uniform float32", "uniform", 10.0), _config("uniform bf16", "uniform", 10.0)
        for _ in range(8):
            e2e._time(["uniform float32", "uniform bf16"], 5)
            if not verify.unsettled(Ctx, e2e, float32, [same]):
                break
        winner, _ = verify.decide(Ctx, e2e, float32, [same.with_(meets_budget=True)])
        wins += winner.name == "uniform bf16"
    assert wins <= 1  # the interval's 2.5% one-sided error rate, on 30 runs


def test_final_rounds_are_taken_in_steps_until_settled_and_cached(tmp_path):
    from autopolicy.search.cache import MeasurementCache
    from autopolicy.search.endtoend import EndToEnd, config_key

    configs = [_config("uniform float32", "uniform", 1.0), _config("uniform bf16", "uniform", 1.0)]
    cache = MeasurementCache(None)
    e2e = EndToEnd(None, {}, cache, "fingerprint", "digest", [[1, 4]])
    steps = []

    def fake_time(todo, rounds):
        steps.append(rounds)
        e2e.rounds += [{config_key(c): 1.0 for c in todo} for _ in range(rounds)]

    e2e._time = fake_time
    looks = iter([configs, []])
    group = e2e.time_until(configs, 40, 10, lambda: next(looks), "final")
    assert steps == [10, 10] and len(e2e.rounds) == 20  # settled at the second look: 20 of 40 rounds
    assert len(cache.lookup(group)["rounds"]) == 20
    again = EndToEnd(None, {}, cache, "fingerprint", "digest", [[1, 4]])
    again._time = fake_time
    assert again.time_until(configs, 40, 10, lambda: configs, "final") == group
    assert steps == [10, 10] and len(again.rounds) == 20 and again.from_cache  # no new timing


def test_final_rounds_time_only_float32_and_the_configurations_still_undecided():
    # 0.83x and 1.67x are decided after the first step; only the close call (1.015x) and float32
    # are timed on, so its interval gets the rounds.
    float32, slow, fast, close = (_config("uniform float32", "uniform", 10.0), _config("uniform int8", "uniform", 12.0),
                                  _config("map (round 1)", "map", 6.0), _config("map (round 2)", "map", 9.85))
    e2e = SteppedEndToEnd({"uniform float32": 10.0, "uniform int8": 12.0, "map (round 1)": 6.0,
                           "map (round 2)": 9.85}, 0.03, 10)
    assert [c.name for c in verify.unsettled(Ctx, e2e, float32, [slow, fast, close])] == ["uniform float32",
                                                                                         "map (round 2)"]
    assert verify.unsettled(Ctx, e2e, float32, [slow, fast]) == []  # nothing left: the rounds stop


def test_final_rounds_narrow_only_once_every_pair_has_an_interval():
    # A map decided over float32 on the calibration rounds' figures alone would leave decide()
    # comparing it with the uniform policy it challenges (1.25x float32) on fewer than 3 shared
    # rounds.
    float32, int8, fast = (_config("uniform float32", "uniform", 10.0), _config("uniform int8", "uniform", 8.0),
                           _config("map (round 1)", "map", 6.0))
    e2e = SteppedEndToEnd({"uniform float32": 10.0, "uniform int8": 8.0, "map (round 1)": 6.0}, 0.02, 10)
    e2e.samples_["map (round 1)"][:8] = [math.nan] * 8  # the map was timed in the last 2 rounds only
    assert [c.name for c in verify.unsettled(Ctx, e2e, float32, [int8, fast])] == ["uniform float32", "uniform int8",
                                                                                  "map (round 1)"]
    e2e._time(["uniform float32", "uniform int8", "map (round 1)"], 1)
    assert verify.unsettled(Ctx, e2e, float32, [int8, fast]) == []


def test_a_uniform_policy_clearly_slower_than_float32_is_not_timed_with_the_maps():
    # The calibration rounds put bf16 at 0.83x float32: it can neither replace float32 nor be
    # the incumbent a map challenges, so a new map's rounds leave it out; int8 (1.25x) stays.
    float32, bf16, int8, new_map = (_config("uniform float32", "uniform", 10.0), _config("uniform bf16", "uniform", 12.0),
                                    _config("uniform int8", "uniform", 8.0), _config("map (round 1)", "map", 6.0))
    e2e = SteppedEndToEnd({"uniform float32": 10.0, "uniform bf16": 12.0, "uniform int8": 8.0,
                           "map (round 1)": 6.0}, 0.02, 10)
    e2e.samples_["map (round 1)"][:] = [math.nan] * 10  # calibration timed the uniform policies only
    assert [c.name for c in verify.unsettled(Ctx, e2e, float32, [new_map, bf16, int8])] == [
        "uniform float32", "map (round 1)", "uniform int8"]
    # Where float32 cannot be chosen, the fastest other configuration is the incumbent: all stay.
    excluded = float32.with_(excluded="over the memory budget")
    assert [c.name for c in verify.unsettled(Ctx, e2e, excluded, [new_map, bf16, int8])] == [
        "uniform float32", "map (round 1)", "uniform bf16", "uniform int8"]
    # Two rounds are too few for an interval: a policy is not left out on them.
    e2e = SteppedEndToEnd({"uniform float32": 10.0, "uniform bf16": 12.0}, 0.02, 2)
    assert verify.unsettled(Ctx, e2e, float32, [bf16]) == [float32, bf16]


def _recording_e2e():
    """Three uniform configurations and an EndToEnd whose rounds take 1 s each, recording what
    each step timed (names, rounds)."""
    from autopolicy.search.cache import MeasurementCache
    from autopolicy.search.endtoend import EndToEnd, config_key

    configs = [_config(n, "uniform", 1.0) for n in ("uniform float32", "uniform bf16", "uniform int8")]
    e2e = EndToEnd(None, {}, MeasurementCache(None), "fingerprint", "digest", [[1, 4]])
    timed = []

    def fake_time(todo, rounds):
        timed.append(([c.name for c in todo], rounds))
        e2e.rounds += [{config_key(c): 1.0 for c in todo} for _ in range(rounds)]

    e2e._time = fake_time
    return configs, e2e, timed


def test_time_until_asks_first_what_earlier_groups_left_undecided():
    configs, e2e, timed = _recording_e2e()
    looks = iter([[configs[0], configs[2]], []])
    e2e.time_until(configs, 40, 10, lambda: next(looks), "final", first=True)
    assert timed == [(["uniform float32", "uniform int8"], 10)]
    e2e.time_until(configs, 40, 10, lambda: [], "other", first=True)  # all decided already: no rounds
    assert timed == [(["uniform float32", "uniform int8"], 10)] and len(e2e.rounds) == 10


def test_a_fresh_group_after_a_cached_one_may_take_extra_rounds():
    from autopolicy.search.cache import MeasurementCache
    from autopolicy.search.endtoend import EndToEnd, config_key

    configs = [_config("uniform float32", "uniform", 1.0), _config("uniform bf16", "uniform", 1.0)]
    cache = MeasurementCache(None)
    first = EndToEnd(None, {}, cache, "fingerprint", "digest", [[1, 4]])

    def fake_time(e2e):
        def run(todo, rounds):
            e2e.rounds += [{config_key(c): 1.0 for c in todo} for _ in range(rounds)]
        return run

    first._time = fake_time(first)
    first.time_group(configs, 5, "calibration")
    later = EndToEnd(None, {}, cache, "fingerprint", "digest", [[1, 4]])
    later._time = fake_time(later)
    later.time_group(configs, 5, "calibration")  # a later run: the calibration rounds from the cache
    assert later.from_cache and not later.more(configs, 3) and len(later.rounds) == 5
    new_map = _config("map (round 1)", "map", 1.0)
    later.time_until(configs + [new_map], 10, 5, lambda: [], "final")  # its own map: timed afresh
    assert not later.from_cache and later.more([configs[0], new_map], 3)
    assert later.rounds_together([configs[0], new_map]) == 8


def test_a_group_whose_kernels_changed_on_some_maps_times_only_those_again():
    # A later run's profile chose another float8 kernel for layer "a": the calibration rounds of
    # float32 and int8 are kept, and float8 is timed again with float32 (the reference).
    from autopolicy.search.cache import MeasurementCache
    from autopolicy.search.endtoend import EndToEnd, config_key

    def uniform(name):
        config = _config(f"uniform {name}", "uniform", 1.0)
        return dataclasses.replace(config, assignment={"a": name, "b": name})

    configs = [uniform("float32"), uniform("int8"), uniform("float8")]
    cache = MeasurementCache(None)
    timed = []

    def run(kernels):
        e2e = EndToEnd(None, {}, cache, "fingerprint", "digest", [[1, 4]], kernels=kernels)

        def fake_time(todo, rounds):
            timed.append(([c.name for c in todo], rounds))
            e2e.rounds += [{e2e.key_of(c): 1.0 for c in todo} for _ in range(rounds)]

        e2e._time = fake_time
        e2e.time_group(configs, 5, "calibration")
        return e2e

    first = run({"a": {"int8": "cpu_ffi", "float8": "emulated"}})
    assert timed == [(["uniform float32", "uniform int8", "uniform float8"], 5)]
    assert first.key_of(configs[0]) == config_key(configs[0])  # float32 runs no chosen kernel
    assert first.key_of(configs[1]) != config_key(configs[1])
    later = run({"a": {"int8": "cpu_ffi", "float8": "fp8_dot"}})
    assert timed[1:] == [(["uniform float32", "uniform float8"], 5)]
    assert len(later.samples(configs[1])) == 5 and len(later.samples(configs[0])) == 10
    assert later.rounds_together(configs) == 0 and later.rounds_together([configs[0], configs[2]]) == 5
    assert later.speedup(configs[1], configs[0]).rounds == 5
    again = run({"a": {"int8": "cpu_ffi", "float8": "fp8_dot"}})  # the same choice: all from the cache
    assert len(timed) == 2 and again.from_cache and len(again.rounds) == 10


def test_time_until_times_what_pending_names_after_each_step():
    configs, e2e, timed = _recording_e2e()
    looks = iter([[configs[0], configs[2]], [configs[0], configs[2]], []])
    e2e.time_until(configs, 40, 10, lambda: next(looks), "final")
    assert timed == [(["uniform float32", "uniform bf16", "uniform int8"], 10), (["uniform float32", "uniform int8"], 10),
                     (["uniform float32", "uniform int8"], 10)]
    assert len(e2e.samples(configs[1])) == 10 and len(e2e.samples(configs[2])) == 30


def test_a_missed_map_shrinks_the_next_rounds_budget_by_predicted_over_observed(monkeypatch):
    """Summed one-layer costs that ran 2x too low: each next round solves within half the budget
    left before (the estimate's error applies to every layer it adds up), and the missed map's
    layers carry its excess."""
    from types import SimpleNamespace  # pylint: disable=import-outside-toplevel

    from autopolicy.search import verify  # pylint: disable=import-outside-toplevel

    budgets, additions = [], []

    def problem(latency, accuracy, budget, memory_budget, added, calibration, no_reference=()):
        budgets.append(budget)
        additions.append(dict(added))
        return SimpleNamespace(layers=(), budget=budget, memory_budget=memory_budget)

    class Solution:
        accuracy_cost = 0.2

        def __init__(self, i):
            self.i = i

        def policies(self, layers):
            return {"dense": f"map {self.i}"}

    rounds = iter(range(10))
    monkeypatch.setattr(verify, "make_problem", problem)
    monkeypatch.setattr(verify, "headroom", lambda ctx, problem: None)
    monkeypatch.setattr(verify.solver, "solve", lambda layers, budget, memory: Solution(next(rounds)))
    monkeypatch.setattr(verify, "_verified", lambda ctx, models, index, p, s: SimpleNamespace(
        assignment=s.policies(()), meets_budget=False, metric=0.4, changed={"dense": "int8_from_float32"}))
    ctx = SimpleNamespace(progress=False, max_rounds=3,
                          budget=SimpleNamespace(allowed_drop=0.25, memory_budget=None, drop=lambda metric: metric))
    new = verify.solve_and_verify(ctx, None, None, {}, [])
    assert len(new) == 3 and budgets == pytest.approx([0.25, 0.125, 0.0625, 0.03125])  # then the headroom's
    assert additions[1] == {("dense", "int8_from_float32"): pytest.approx(0.2)}  # 0.4 observed - 0.2 predicted


class _FixedSolution:
    """A solver's solution that assigns what it is given, at a summed cost of 0.1."""

    accuracy_cost = 0.1

    def __init__(self, assignment):
        self.assignment = assignment

    def policies(self, layers):
        return self.assignment


def test_a_uniform_policy_within_budget_anchors_one_more_map_solved_without_float32_where_it_reaches(monkeypatch):
    """After the repair rounds, the fastest uniform policy (by the latency model) that met the
    budget anchors one more solve: float32 is taken away from the layers it covers. A solution
    equal to that uniform policy is not scored again."""
    from types import SimpleNamespace  # pylint: disable=import-outside-toplevel

    from autopolicy.search import verify  # pylint: disable=import-outside-toplevel

    seen = []

    def problem(latency, accuracy, budget, memory_budget, added, calibration, no_reference=()):
        seen.append(set(no_reference))
        return SimpleNamespace(layers=(), budget=budget, memory_budget=memory_budget)

    def uniform(name, metric):
        return SimpleNamespace(uniform=name, metric=metric, disqualified=(), excluded="",
                               assignment={"a": name, "b": name, "norm": "float32"})

    uniforms = [uniform("float32", 0.0), uniform("gptq", 0.05), uniform("int8", 0.4), uniform("int4", 0.2)]
    speed = {"float32": 3.0, "gptq": 2.0, "int4": 1.0, "int8": 0.5}
    calibration = SimpleNamespace(predict=lambda latency, assignment: speed[assignment["a"]])
    ctx = SimpleNamespace(progress=False, max_rounds=3, budget=SimpleNamespace(
        allowed_drop=0.25, memory_budget=None, drop=lambda metric: metric, meets=lambda metric: metric <= 0.25))
    monkeypatch.setattr(verify, "make_problem", problem)
    monkeypatch.setattr(verify, "headroom", lambda ctx, problem: None)
    monkeypatch.setattr(verify, "_verified", lambda ctx, models, index, p, s: SimpleNamespace(
        assignment=s.policies(()), meets_budget=True, metric=0.1, round=index))

    def run(*assignments):
        seen.clear()
        solutions = iter(assignments)
        monkeypatch.setattr(verify.solver, "solve", lambda layers, budget, memory: _FixedSolution(next(solutions)))
        return verify.solve_and_verify(ctx, None, None, {}, [], calibration, uniforms)

    mixed = {"a": "int8", "b": "float32", "norm": "float32"}
    anchored = {"a": "int8", "b": "int4", "norm": "float32"}
    new = run(mixed, anchored)
    # int8 is predicted fastest but missed the budget; int4 beats gptq: it anchors.
    assert seen == [set(), {"a", "b"}, {"a", "b"}]  # the plain solve, the anchored one, the headroom's
    assert [n.assignment for n in new] == [mixed, anchored] and new[1].round == 2
    assert [n.assignment for n in run(mixed, uniforms[3].assignment)] == [mixed]  # that is uniform int4
    assert len(seen) == 3
    assert verify._anchor(ctx, None, calibration, uniforms[:3]).uniform == "gptq"
    assert verify._anchor(ctx, None, calibration, [uniforms[0], uniforms[2]]) is None  # none but float32 met it


def test_an_anchored_map_that_misses_the_budget_is_repaired_with_a_smaller_one(monkeypatch):
    """The anchored solve gets the plain solve's repair rounds: a miss (0.3 against 0.25, 0.1
    predicted) shrinks the next anchored solve's budget by predicted / observed, float32 still
    taken away where the anchor reaches; the repaired map that meets the budget ends them."""
    from types import SimpleNamespace  # pylint: disable=import-outside-toplevel

    from autopolicy.search import verify  # pylint: disable=import-outside-toplevel

    seen = []

    def problem(latency, accuracy, budget, memory_budget, added, calibration, no_reference=()):
        seen.append((round(budget, 6), set(no_reference), dict(added)))
        return SimpleNamespace(layers=(), budget=budget, memory_budget=memory_budget)

    def uniform(name, metric):
        return SimpleNamespace(uniform=name, metric=metric, disqualified=(), excluded="",
                               assignment={"a": name, "b": name})

    uniforms = [uniform("float32", 0.0), uniform("gptq", 0.05)]
    calibration = SimpleNamespace(predict=lambda latency, assignment: 1.0)
    ctx = SimpleNamespace(progress=False, max_rounds=3, budget=SimpleNamespace(
        allowed_drop=0.25, memory_budget=None, drop=lambda metric: metric, meets=lambda metric: metric <= 0.25))
    plain = {"a": "int8", "b": "float32"}
    missed, repaired = {"a": "int8", "b": "int8"}, {"a": "int8", "b": "gptq"}
    metric = {str(plain): 0.2, str(missed): 0.3, str(repaired): 0.24}
    solutions = iter([plain, missed, repaired])
    monkeypatch.setattr(verify, "make_problem", problem)
    monkeypatch.setattr(verify, "headroom", lambda ctx, problem: None)
    monkeypatch.setattr(verify.solver, "solve", lambda layers, budget, memory: _FixedSolution(next(solutions)))
    monkeypatch.setattr(verify, "_verified", lambda ctx, models, index, p, s: SimpleNamespace(
        assignment=s.policies(()), metric=metric[str(s.policies(()))],
        meets_budget=metric[str(s.policies(()))] <= 0.25, round=index,
        changed={k: v for k, v in s.policies(()).items() if v != "float32"}))
    new = verify.solve_and_verify(ctx, None, None, {}, [], calibration, uniforms)
    assert [n.assignment for n in new] == [plain, missed, repaired]
    assert [n.round for n in new] == [1, 2, 3]
    excess = (0.3 - 0.1) / 2  # the miss's excess over its two changed layers
    repaired_state = (round(0.25 * 0.1 / 0.3, 6), {"a", "b"}, {("a", "int8"): excess, ("b", "int8"): excess})
    # The headroom map is solved on the repairs' last problem: budget, added costs and anchor.
    assert seen == [(0.25, set(), {}), (0.25, {"a", "b"}, {}), repaired_state, repaired_state]


def _two_layers(min_speedup):
    """float32, int8 (fastest, costly) and gptq (1% slower, nearly free) on two layers."""
    from autopolicy.search import solver  # pylint: disable=import-outside-toplevel
    from autopolicy.search.phases import Problem  # pylint: disable=import-outside-toplevel

    options = (solver.Option("float32", "float32", 2.0), solver.Option("int8", "float32", 1.0, 0.2),
               solver.Option("gptq", "float32", 1.01, 0.01))
    layers = tuple(solver.Layer(name, options) for name in "ab")
    return SimpleNamespace(min_speedup=min_speedup), Problem(layers, 0.5, None)


def test_the_headroom_map_spends_the_least_budget_within_the_margin_of_the_fastest():
    ctx, problem = _two_layers(1.02)
    fastest = verify.solver.solve(problem.layers, problem.budget)
    assert fastest.policies(problem.layers) == {"a": "int8", "b": "int8"}  # 2.0 s, cost 0.4
    safest = verify.headroom(ctx, problem)
    assert safest.policies(problem.layers) == {"a": "gptq", "b": "gptq"}  # 2.02 s (within 2%), cost 0.02
    assert safest.accuracy_cost == pytest.approx(0.02) and safest.latency == pytest.approx(2.02)
    one_gptq = verify.headroom(_two_layers(1.006)[0], problem)  # 2.01 s of 2.012 allowed: one layer only
    assert sorted(one_gptq.policies(problem.layers).values()) == ["gptq", "int8"]
    assert verify.headroom(_two_layers(1.0)[0], problem) is None  # no margin: the fastest is the only one


def test_a_faster_map_replaces_a_more_accurate_one_only_when_faster_by_the_margin():
    seconds = {"uniform float32": 10.0, "uniform int8": 6.0, "map (round 1)": 4.97, "map (round 2)": 5.0}
    spent = {"map (round 1)": 0.24, "map (round 2)": 0.01}  # round 1 used the budget, round 2 barely

    def decide(seconds):
        configs = {n: _config(n, "uniform" if n.startswith("uniform") else "map", s).with_(metric=spent.get(n))
                   for n, s in seconds.items()}
        float32 = configs.pop("uniform float32")
        return verify.decide(Ctx, FakeEndToEnd(seconds, 0.02, 20), float32, list(configs.values()))

    winner, log = decide(seconds)
    assert winner.name == "map (round 2)"  # the more accurate map challenges first and clears int8
    assert "map (round 2) replaces uniform int8" in log[1] and "map (round 1) does not replace map (round 2)" in log[2]
    winner, log = decide({**seconds, "map (round 1)": 4.0})
    assert winner.name == "map (round 1)" and "map (round 1) replaces map (round 2)" in log[2]


@pytest.mark.timeout(60)
def test_a_close_call_stops_when_its_intervals_use_up_the_confirmation_time(monkeypatch):
    """Rounds that cost nothing but intervals that take time (a model timed in microseconds, a
    bootstrap over thousands of rounds): the extra rounds stop once the intervals' own time
    reaches confirm_seconds, and each batch is half the rounds so far (at least the repeats)."""
    import time  # pylint: disable=import-outside-toplevel
    from types import SimpleNamespace  # pylint: disable=import-outside-toplevel

    from autopolicy.search import verify  # pylint: disable=import-outside-toplevel
    from autopolicy.search.confidence import Speedup  # pylint: disable=import-outside-toplevel

    asked = []

    class Rounds:
        extra_seconds = 0.0  # the rounds themselves take no time
        total = 6

        def speedup(self, a, b):
            time.sleep(0.02)
            return Speedup(1.02, 0.9, 1.1, self.total, 0.95)  # straddles the margin every time

        def more(self, configs, rounds):
            asked.append(rounds)
            self.total += rounds
            return True

    ctx = SimpleNamespace(min_speedup=1.02, confirm_seconds=0.1, repeats=4)
    speedup = verify._challenge(ctx, Rounds(), "map", "uniform")
    assert speedup.straddles(1.02)
    assert 3 <= len(asked) <= 8  # about confirm_seconds / 0.02 s of intervals
    assert asked[:4] == [4, 5, 7, 11]  # max(repeats, rounds so far // 2): 6 -> 10 -> 15 -> 22 rounds
