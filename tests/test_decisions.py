"""Decisions that survive noise: paired speed-ups with intervals, the decision rule, the
calibrated latency model and the noise verdict, on synthetic timings (no machine timing)."""

import math

import numpy as np
import pytest

from autopolicy import policies
from autopolicy.search import confidence, latency_model, noise, verify
from autopolicy.search.adapter import TunableLayer
from autopolicy.search.phases import Configuration, LatencyProfile, LayerTiming, Site

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
    assert "over 70 rounds" in log[-1]  # 20 + 5 batches of 10


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
