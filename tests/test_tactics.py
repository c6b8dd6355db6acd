"""Kernels as tactics: a layer's choice of kernel (with_kernels), saved with the model, timed per
kernel by the search at the layer's real shape and run by the tuned model."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy.nn as nn
from autopolicy import policies, search
from autopolicy.numerics import cpu_kernels, kernels
from autopolicy.numerics.device import Device
from autopolicy.search import _report_tables, profiling, verify
from autopolicy.search import result as result_module
from autopolicy.search.adapter import get_adapter
from autopolicy.search.cache import MeasurementCache
from autopolicy.search.endtoend import EndToEnd, config_key
from autopolicy.search.phases import AccuracyProfile, Configuration, LatencyProfile, LayerTiming
from tests.helpers import gaussian

VNNI = Device("cpu", "stand-in Xeon", cpu_features=("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"))
AVX2 = Device("cpu", "stand-in EPYC", cpu_features=("avx2", "fma"))
X = gaussian((64, 48), seed=3)
#: autopolicy's FFI kernel, a candidate wherever its library is built.
FFI = ("cpu_ffi",) if cpu_kernels.AVAILABLE and jax.device_count() == 1 else ()
#: On the VNNI stand-in, its AVX2 path as well (a kernel of its own where this CPU runs AVX2);
#: also what a layer can run here (kernel_choices: the kernels this process runs).
FFI_VNNI = FFI + (("cpu_ffi_avx2",) if FFI and "avx2" in cpu_kernels.supported_paths() else ())


@pytest.fixture(scope="module")
def model():
    mlp = nn.Sequential([nn.Dense(96, activation="relu", name="a"), nn.Dense(32, name="b")], name="m")
    return mlp.build(jax.random.key(0), X)


def test_with_kernels_runs_each_kernel_bit_identically_and_names_them(model):
    quantized = model.quantize("int8")
    y = np.asarray(quantized(X))
    for name in ("s8s8", "u8s8") + FFI_VNNI:
        chosen = quantized.with_kernels({"m/a": name, "m/b": name})
        assert chosen.kernels() == {"m/a": name, "m/b": name}
        np.testing.assert_array_equal(np.asarray(chosen(X)), y)
    assert quantized.kernels() == {}


def test_with_kernels_refuses_bad_paths_kernels_and_float_layers(model):
    quantized = model.quantize("int8")
    with pytest.raises(ValueError, match=r"Expected one of \[('cpu_ffi', )?('cpu_ffi_avx2', )?'s8s8', 'u8s8'\] or None. Received: 'vnni'"):
        quantized.with_kernels({"m/a": "vnni"})
    with pytest.raises(ValueError, match=r"'m/c' is not a layer path of 'm'; did you mean"):
        quantized.with_kernels({"m/c": "s8s8"})
    with pytest.raises(ValueError, match=r"'m/a' \(policy 'float32'\) has no choice of kernels"):
        model.with_kernels({"m/a": "s8s8"})
    with pytest.raises(TypeError, match="takes a dict"):
        quantized.with_kernels(["s8s8"])


def test_a_new_policy_resets_the_kernel_choice(model):
    chosen = model.with_dtype_policy("float8_from_float32").with_kernels({"m/a": "emulated"})
    assert chosen.kernels() == {"m/a": "emulated"}
    assert chosen.with_dtype_policy("float32").kernels() == {}


def test_the_kernel_choice_is_saved_with_the_model(model, tmp_path):
    chosen = model.quantize("int8").with_kernels({"m/b": "u8s8"})
    nn.save(chosen, tmp_path / "saved")
    loaded = nn.load(tmp_path / "saved")
    assert loaded.kernels() == {"m/b": "u8s8"}
    np.testing.assert_array_equal(np.asarray(loaded(X)), np.asarray(chosen(X)))


@pytest.mark.skipif("cpu_ffi_avx2" not in FFI_VNNI, reason="needs the CPU kernels with an AVX2 path")
def test_a_saved_kernel_this_process_cannot_run_falls_back_to_the_default_with_a_warning(
        model, tmp_path, monkeypatch, caplog):
    """Tuned on one machine, loaded on another: a layer whose saved kernel cannot run here (its
    SIMD path missing, as on a CPU without AVX2) takes the default, the others keep theirs."""
    chosen = model.quantize("int8").with_kernels({"m/a": "cpu_ffi_avx2", "m/b": "s8s8"})
    nn.save(chosen, tmp_path / "saved")
    monkeypatch.setattr(cpu_kernels, "supported_paths", lambda: ("portable",))  # a CPU without AVX2
    with caplog.at_level("WARNING", logger="autopolicy"):
        loaded = nn.load(tmp_path / "saved")
    assert loaded.kernels() == {"m/b": "s8s8"}
    assert "1 layer(s) were saved with kernels this process cannot run (cpu_ffi_avx2, e.g. 'm/a')" in caplog.text
    monkeypatch.undo()
    np.testing.assert_array_equal(np.asarray(loaded(X)), np.asarray(chosen(X)))  # int8 kernels: exact


def test_kernel_choices_follow_the_device(model, monkeypatch):
    layer = model.quantize("int8").layers_by_path()["m/a"]
    monkeypatch.setattr(kernels, "current_device", lambda: AVX2)
    assert layer.kernel_choices() == ("s8s8", "u8s8") + FFI_VNNI
    monkeypatch.setattr(kernels, "current_device", lambda: VNNI)
    assert layer.kernel_choices() == ("u8s8", "s8s8") + FFI_VNNI


def _timed_as(seconds, cv):
    """A stand-in for timing.measure: every candidate at its given seconds and spread."""
    def measure(todo, repeats, pending=()):
        return {name: search.timing.Timing(seconds[name], seconds[name], seconds[name], cv, repeats, 1) for name in todo}
    return measure


@pytest.mark.parametrize("second_run,kept", [
    # The first run timed u8s8 1.0 ms and s8s8 1.2 ms (ms; the two runs' mean decides).
    ({"u8s8": 1.00, "s8s8": 0.97}, "u8s8"),  # s8s8 faster now, slower on both runs together
    ({"u8s8": 1.00, "s8s8": 0.75}, "u8s8"),  # s8s8 faster now by 25%, on both runs by 2.5%: within the margin
    ({"u8s8": 1.00, "s8s8": 0.60}, "s8s8"),  # s8s8 clearly faster on both runs together (0.90 ms): it wins
    ({"u8s8": 1.40, "s8s8": 1.00}, "s8s8"),  # u8s8 clearly slower now: s8s8 (1.1 ms) beats it (1.2 ms) together
])
def test_a_noisy_timing_measured_again_keeps_the_earlier_kernel_unless_another_is_clearly_faster(
        model, monkeypatch, tmp_path, second_run, kept):
    monkeypatch.setattr(kernels, "current_device", lambda: AVX2)  # default s8s8, then u8s8
    monkeypatch.setattr(cpu_kernels, "AVAILABLE", False)  # two kernels: the XLA ones
    adapter = get_adapter(model, (X,), [(X,)])
    sites = profiling.sites(adapter.layers(), [policies.get("int8_from_float32")])
    names = {"s8s8": "int8_from_float32@s8s8", "u8s8": "int8_from_float32@u8s8", "float32": "float32"}
    with MeasurementCache(str(tmp_path)) as cache:  # the first run: u8s8 clearly faster, all timings noisy
        monkeypatch.setattr(search.timing, "measure", _timed_as(
            {names["s8s8"]: 1.2e-3, names["u8s8"]: 1.0e-3, "float32": 2e-3}, cv=0.3))
        first = profiling.layer_latency(adapter, sites[0], cache, "fp", repeats=3)
    assert first["int8_from_float32"].kernel == "u8s8"
    with MeasurementCache(str(tmp_path)) as cache:  # a later run measures the noisy timings again
        monkeypatch.setattr(search.timing, "measure", _timed_as(
            {names[k]: 1e-3 * v for k, v in second_run.items()} | {"float32": 2e-3}, cv=0.3))
        again = profiling.layer_latency(adapter, sites[0], cache, "fp", repeats=3)
    assert again["int8_from_float32"].kernel == kept
    assert again["int8_from_float32"].latency_s == pytest.approx(1e-3 * second_run[kept])
    assert dict(again["int8_from_float32"].tactics) == pytest.approx({k: 1e-3 * v for k, v in second_run.items()})


def test_layers_of_one_signature_keep_the_earlier_kernel_alike_when_measured_again(monkeypatch, tmp_path):
    # The first layer of a signature measures again; the others read its new record, which keeps
    # the earlier run's median, so they decide as it did (not by the new timings alone).
    twins = nn.Sequential([nn.Dense(48, name="a"), nn.Dense(48, name="b")], name="t").build(jax.random.key(1), X)
    monkeypatch.setattr(kernels, "current_device", lambda: AVX2)
    monkeypatch.setattr(cpu_kernels, "AVAILABLE", False)
    adapter = get_adapter(twins, (X,), [(X,)])
    sites = profiling.sites(adapter.layers(), [policies.get("int8_from_float32")])
    assert [s.layer.signature for s in sites[:1]] == [sites[1].layer.signature]
    s8s8, u8s8 = "int8_from_float32@s8s8", "int8_from_float32@u8s8"
    with MeasurementCache(str(tmp_path)) as cache:
        monkeypatch.setattr(search.timing, "measure", _timed_as({s8s8: 1.2e-3, u8s8: 1.0e-3, "float32": 2e-3}, cv=0.3))
        fresh = set()  # keys measured in this run
        first = [profiling.layer_latency(adapter, site, cache, "fp", repeats=3, fresh=fresh) for site in sites]
    assert [t["int8_from_float32"].kernel for t in first] == ["u8s8", "u8s8"]
    with MeasurementCache(str(tmp_path)) as cache:  # s8s8 25% faster now: 2.5% on both runs
        measure, measured = _timed_as({s8s8: 0.75e-3, u8s8: 1.0e-3, "float32": 2e-3}, cv=0.3), []
        monkeypatch.setattr(search.timing, "measure", lambda todo, **kw: measured.append(sorted(todo)) or measure(todo, **kw))
        fresh = set()
        again = [profiling.layer_latency(adapter, site, cache, "fp", repeats=3, fresh=fresh) for site in sites]
        assert measured == [["float32", s8s8, u8s8]]  # once: the second layer reads the first's new records
        record = cache.lookup(profiling.key("fp", "latency", sites[1].layer.signature, "int8_from_float32", "s8s8",
                                            3, search.timing.METHOD))
    assert [t["int8_from_float32"].kernel for t in again] == ["u8s8", "u8s8"]
    assert (record["latency_s"], record["previous_latency_s"], record["remeasured"]) == (0.75e-3, 1.2e-3, True)


def test_the_search_times_every_kernel_and_keeps_the_fastest(model, monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "current_device", lambda: VNNI)  # both int8 kernels worth timing
    adapter = get_adapter(model, (X,), [(X,)])
    sites = profiling.sites(adapter.layers(), [policies.get("int8_from_float32")])
    with MeasurementCache(str(tmp_path)) as cache:
        fresh = set()  # measured in this run: reused as they are, however noisy
        table = profiling.layer_latency(adapter, sites[0], cache, "fp", repeats=3, fresh=fresh)
        again = profiling.layer_latency(adapter, sites[0], cache, "fp", repeats=3, fresh=fresh)
        timed = 3 + len(FFI_VNNI)  # float32, int8 x its kernels
        assert (cache.hits, cache.misses) == (timed, timed)
    int8 = table["int8_from_float32"]
    assert [name for name, _ in int8.tactics] == ["u8s8", "s8s8"] + list(FFI_VNNI)
    seconds = dict(int8.tactics)
    default = seconds["u8s8"]
    fastest = min(seconds, key=seconds.get)
    expected = fastest if seconds[fastest] < 0.95 * default else "u8s8"
    assert int8.kernel == expected
    assert int8.latency_s == seconds[expected]
    assert table["float32"].kernel == "" and table["float32"].tactics == ()
    assert again["int8_from_float32"] == int8  # the second call is served from the cache
    choice = profiling.kernel_choice(LatencyProfile(sites[:1], {sites[0].path: table}, {}))
    assert choice == {"m/a": {"int8_from_float32": expected}}
    adapter.use_kernels({"m/a": {"int8_from_float32": "s8s8"}, "m/b": {"int8_from_float32": "u8s8"}})
    built = adapter.with_policies(adapter.complete_map({"m/a": "int8_from_float32", "m/b": "int8_from_float32"}))
    assert built.kernels() == {"m/a": "s8s8", "m/b": "u8s8"}
    assert adapter.with_policies(adapter.complete_map({"m/a": "float32"})).kernels() == {}


def test_a_tuned_model_runs_the_kernels_its_profile_names(model, monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "current_device", lambda: VNNI)
    y = np.asarray(model(X))

    def fidelity(m):
        return -float(np.mean((np.asarray(m(X)) - y) ** 2))

    result = search.tune(model, fidelity, X, max_drop=1.0, relative=False, repeats=3, candidates=["int8_from_float32"],
                         progress=False, cache_dir=str(tmp_path), confirm_seconds=0)
    profile = result.profile.set_index(["layer", "policy"])
    for path in ("m/a", "m/b"):
        row = profile.loc[(path, "int8_from_float32")]
        assert row["kernel"] in ("s8s8", "u8s8") + FFI_VNNI
        assert row["tactics"].startswith("u8s8 ") and ", s8s8 " in row["tactics"]
        if result.policy_map[path].name == "int8_from_float32":
            assert result.model.layers_by_path()[path].kernel_choices()  # quantized
            assert result.model.kernels().get(path) == row["kernel"]


def _timing(kernel, tactics):
    seconds = dict(tactics)[kernel]
    return LayerTiming(seconds, seconds, seconds, 0.01, 3, 1, True, 1000, kernel=kernel, tactics=tuple(tactics))


def _chosen_map(adapter, latency, assignment):
    return Configuration("map (round 1)", "map", assignment, adapter.complete_map(assignment), 1e-3)


def test_kernel_sets_put_each_timed_kernel_on_every_layer_that_timed_it_within_the_limit(model, monkeypatch):
    monkeypatch.setattr(kernels, "current_device", lambda: VNNI)
    adapter = get_adapter(model, (X,), [(X,)])
    int8 = "int8_from_float32"
    sites = profiling.sites(adapter.layers(), [policies.get(int8)])
    latency = LatencyProfile(tuple(sites), {
        "m/a": {int8: _timing("u8s8", (("u8s8", 1.0e-3), ("s8s8", 1.2e-3), ("xla_slow", 9.0e-3)))},
        "m/b": {int8: _timing("s8s8", (("u8s8", 2.1e-3), ("s8s8", 2.0e-3)))},
    }, {})
    choice = profiling.kernel_choice(latency)
    winner = _chosen_map(adapter, latency, {"m/a": int8, "m/b": int8})
    # u8s8 on m/b: 1.0 + 2.1 over 1.0 + 2.0; s8s8 on m/a: 1.2 + 2.0 over 3.0; xla_slow: 11/3 > 1.5.
    assert verify.kernel_sets(latency, winner, choice) == [
        ("u8s8", {"m/b": "u8s8"}, pytest.approx(3.1 / 3.0)), ("s8s8", {"m/a": "s8s8"}, pytest.approx(3.2 / 3.0))]
    on_float = _chosen_map(adapter, latency, {"m/a": "float32", "m/b": int8})
    assert verify.kernel_sets(latency, on_float, choice) == [("u8s8", {"m/b": "u8s8"}, pytest.approx(2.1 / 2.0))]
    assert verify.kernel_sets(latency, _chosen_map(adapter, latency, {"m/a": "float32", "m/b": "float32"}),
                              choice) == []


class _ScriptedRounds(EndToEnd):
    """End-to-end rounds whose seconds are given per configuration name (1% seeded noise)."""

    def __init__(self, adapter, models, cache, seconds):
        super().__init__(adapter, models, cache, "fp", "digest", [(64, 48)])
        self.seconds = seconds
        self.rng = np.random.default_rng(0)
        self.timed_rounds = 0

    def _time(self, configs, rounds):
        self.timed_rounds += rounds
        for _ in range(rounds):
            self.rounds.append({config_key(c): self.seconds[c.name] * (1 + 0.01 * self.rng.standard_normal())
                                for c in configs})


@pytest.mark.parametrize("s8s8_seconds, replaced", [(0.9e-3, True), (1.1e-3, False)])
def test_a_kernel_set_replaces_the_kernels_timed_alone_only_when_faster_end_to_end(
        model, monkeypatch, tmp_path, s8s8_seconds, replaced):
    monkeypatch.setattr(kernels, "current_device", lambda: VNNI)
    adapter = get_adapter(model, (X,), [(X,)])
    int8 = "int8_from_float32"
    sites = profiling.sites(adapter.layers(), [policies.get(int8)])
    float32 = LayerTiming(3e-3, 3e-3, 3e-3, 0.01, 3, 1, True, 4000)
    latency = LatencyProfile(tuple(sites), {
        "m/a": {int8: _timing("u8s8", (("u8s8", 1.0e-3), ("s8s8", 1.1e-3))), "float32": float32},
        "m/b": {int8: _timing("u8s8", (("u8s8", 1.0e-3), ("s8s8", 1.2e-3))), "float32": float32},
    }, {})
    choice = profiling.kernel_choice(latency)
    adapter.use_kernels(choice)
    winner = _chosen_map(adapter, latency, {"m/a": int8, "m/b": int8})
    reference = Configuration("uniform float32", "uniform", {}, adapter.complete_map({}), 3e-3, uniform="float32")
    models = {winner.name: adapter.with_policies(winner.policy_map), reference.name: model}
    ctx = types.SimpleNamespace(adapter=adapter, repeats=4)
    seconds = {reference.name: 3e-3, winner.name: 1e-3, f"{winner.name} on s8s8": s8s8_seconds}
    with MeasurementCache(str(tmp_path)) as cache:
        e2e = _ScriptedRounds(adapter, models, cache, seconds)
        chosen, log = verify.confirm_kernels(ctx, latency, winner, reference, models, e2e, choice)
        assert e2e.timed_rounds == 4  # settled after the first step of half the repeats
        again = _ScriptedRounds(adapter, models, cache, seconds)  # a rerun reads the rounds back
        assert verify.confirm_kernels(ctx, latency, winner, reference, models, again, choice)[1] == log
        assert again.timed_rounds == 0
    assert len(log) == 1
    assert log[0].startswith(f"kernels: s8s8 on 2 more layer(s) (timed alone 1.150x the seconds) "
                             f"{'replaces' if replaced else 'does not replace'} the kernels timed fastest alone "
                             "in map (round 1): ")
    assert set(models) == {winner.name, reference.name}  # the set's model kept only where it won
    assert chosen.name == winner.name
    # The profile's kernel column names what the chosen layers run.
    profile = _report_tables.profile_frame(latency, AccuracyProfile({}, "skipped", 0), chosen)
    assert profile[profile.chosen].set_index("layer")["kernel"].to_dict() == (
        {"m/a": "s8s8", "m/b": "s8s8"} if replaced else {"m/a": "u8s8", "m/b": "u8s8"})
    if replaced:
        assert chosen.kernels == (("m/a", "s8s8"), ("m/b", "s8s8"))
        assert models[winner.name].kernels() == {"m/a": "s8s8", "m/b": "s8s8"}
        assert chosen.speedup == pytest.approx(3.0 / 0.9, rel=0.03) and chosen.rounds == 4
        assert chosen.measured_latency_s == pytest.approx(0.9e-3, rel=0.03)
    else:
        assert chosen is winner
        assert models[winner.name].kernels() == {"m/a": "u8s8", "m/b": "u8s8"}
    # The adapter is left with the kernels timed alone.
    assert adapter.with_policies(winner.policy_map).kernels() == {"m/a": "u8s8", "m/b": "u8s8"}


def test_a_tuned_maps_kernels_travel_in_its_sidecar(model, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels, "current_device", lambda: VNNI)
    y = np.asarray(model(X))

    def fidelity(m):
        return -float(np.mean((np.asarray(m(X)) - y) ** 2))

    result = search.tune(model, fidelity, X, max_drop=1.0, relative=False, repeats=3, candidates=["int8_from_float32"],
                         progress=False, cache_dir=str(tmp_path / "cache"), confirm_seconds=0)
    assert result.kernels == result.model.kernels()  # every quantized layer of the tuned model, by name
    result.save(tmp_path / "run")
    sidecar = tmp_path / "run" / "policy_map.kernels.json"
    kernels_read = search.load_kernels(sidecar)
    assert kernels_read == result.kernels
    rebuilt = model.with_dtype_policy(policies.load_policy_map(tmp_path / "run" / "policy_map.json"))
    assert rebuilt.with_kernels(search.load_kernels(sidecar, rebuilt)).kernels() == result.kernels
    # A kernel this process cannot run (chosen on another machine) is left out, with a warning.
    quantized = model.quantize("int8")
    foreign = tmp_path / "foreign.kernels.json"
    result_module.save_kernels({"m/a": "s8s8", "m/b": "amx_only"}, foreign, "elsewhere")
    with caplog.at_level("WARNING"):
        assert search.load_kernels(foreign, quantized) == {"m/a": "s8s8"}
    assert "1 layer(s) were chosen with kernels this process cannot run (amx_only, e.g. 'm/b')" in caplog.text
    (tmp_path / "bad.json").write_text('{"kernels": {"m/a": 3}}')
    with pytest.raises(ValueError, match=r"bad\.json' is not a kernel sidecar \(expected a JSON object with "
                                         r"\"format\": 'autopolicy\.kernels/1'"):
        search.load_kernels(tmp_path / "bad.json")
    assert result_module.kernels_path("runs/x/map.json") == "runs/x/map.kernels.json"
    assert result_module.kernels_path("map") == "map.kernels.json"
