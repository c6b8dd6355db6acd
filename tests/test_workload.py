"""Workloads: requests parsed, phases built for a decoder, layer profiles and end-to-end rounds
combined by their weights, and a tune that minimises a prefill plus decode steps."""

import json
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopolicy import cli, nn, search
from autopolicy.nn import generation
from autopolicy.search import workload
from autopolicy.search.endtoend import EndToEnd
from autopolicy.search.phases import LatencyProfile, LayerTiming, Site

CONFIG = nn.LlamaConfig(vocab_size=256, dim=64, blocks=2, heads=4, kv_heads=2, mlp_dim=128, max_length=128)


@pytest.fixture(scope="module")
def decoder():
    return nn.LlamaDecoder(CONFIG, name="tiny").build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def test_requests_parse_with_weights():
    assert workload.parse_requests(" prefill=512 , decode=128 ") == (workload.Request(512, 128, 1.0),)
    two = workload.parse_requests("prefill=64,decode=256,weight=3;prefill=512,decode=0,weight=0.5")
    assert two == (workload.Request(64, 256, 3.0), workload.Request(512, 0, 0.5))


@pytest.mark.parametrize("text,message", [
    ("", "A workload is prefill=P,decode=G"),
    ("prefill=512", "it needs both prefill= and decode="),
    ("prefill=512,decode=12,prompt=3", "'prompt=3' is not one of prefill=, decode=, weight="),
    ("prefill=512,prefill=3,decode=1", "'prefill=3' is not one of"),
    ("prefill=5x,decode=1", "prefill must be an int. Received: prefill='5x'"),
    ("prefill=5,decode=1,weight=a", "weight must be a number. Received: weight='a'"),
    ("prefill=0,decode=1", "prefill must be >= 1. Received: prefill=0"),
    ("prefill=4,decode=-1", "decode must be an int >= 0. Received: decode=-1"),
    ("prefill=4,decode=1,weight=0", "weight must be a finite number > 0. Received: weight=0.0"),
])
def test_bad_requests_are_named(text, message):
    with pytest.raises(ValueError, match=None) as info:
        workload.parse_requests(text)
    assert message in str(info.value)


def test_phases_are_checked():
    args = (np.ones((1, 2), np.int32),)
    with pytest.raises(ValueError, match="at least one Phase"):
        workload.check_phases([])
    with pytest.raises(TypeError, match="autopolicy.search.Phase objects"):
        workload.check_phases([args])
    with pytest.raises(ValueError, match="unique, non-empty name without '@'. Received: name='a'"):
        workload.check_phases([search.Phase("a", args), search.Phase("a", args)])
    with pytest.raises(ValueError, match="Phase 'a': weight must be a finite number > 0"):
        workload.check_phases([search.Phase("a", args, weight=float("inf"))])
    assert workload.check_phases(search.Phase("a", args)) == (search.Phase("a", args),)


def test_decoder_phases_merge_and_shape(decoder):
    requests = workload.parse_requests("prefill=32,decode=16;prefill=32,decode=16,weight=2;prefill=8,decode=0")
    phases = generation.workload_phases(decoder, requests, batch=2)
    assert [(p.name, p.weight) for p in phases] == [("prefill 32", 3.0), ("decode at 48", 48.0), ("prefill 8", 1.0)]
    prefill, decode, short = phases
    ids, start, cache, at = prefill.sample_input
    assert ids.shape == (2, 32) and ids.dtype == np.int32 and int(start) == 0 and at.tolist() == [31]
    assert nn.LlamaDecoder.cache_length(cache) == 48 and prefill.step_carry is None
    token, start, cache = decode.sample_input
    assert token.shape == (2, 1) and int(start) == 47 and decode.step_carry is generation.next_step_input
    assert nn.LlamaDecoder.cache_length(short.sample_input[2]) == 8
    logits, new_cache = decoder(*prefill.sample_input)
    assert logits.shape == (2, 1, CONFIG.vocab_size)
    with pytest.raises(ValueError, match="prefill=100 \\+ decode=100 = 200 tokens exceeds the model's max_length=128"):
        generation.workload_phases(decoder, [workload.Request(100, 100)])
    with pytest.raises(ValueError, match="batch must be an int >= 1. Received: batch=0"):
        generation.workload_phases(decoder, requests, batch=0)


def test_logits_at_selects_positions_exactly(decoder):
    ids = jnp.asarray(np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, 12)), jnp.int32)
    every, _ = decoder(ids, 0, decoder.init_cache(2, 16))
    some, _ = decoder(ids, 0, decoder.init_cache(2, 16), jnp.asarray([11, 4], jnp.int32))
    np.testing.assert_array_equal(np.asarray(some), np.asarray(every)[:, [11, 4]])
    last, _ = generation.prefill(decoder, decoder.init_cache(2, 16), ids, jnp.asarray([11], jnp.int32))
    np.testing.assert_allclose(np.asarray(last)[:, 0], np.asarray(every)[:, 11], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="logits_at must be a 1-D integer array"):
        decoder(ids, 0, decoder.init_cache(2, 16), jnp.asarray([[1]], jnp.int32))


def _site(path, index):
    layer = types.SimpleNamespace(path=path, input_shape=(1, 4), gather=False)
    return Site(index, layer, False, ())


def _timing(seconds, tactics=(), nbytes=100):
    return LayerTiming(seconds, seconds, seconds, 0.01, 5, 1, True, nbytes, min(tactics, key=lambda t: t[1])[0]
                       if tactics else "", 0.0, tuple(tactics))


def test_profiles_combine_by_weight_with_one_kernel_for_every_phase():
    # Phase A (x1) prefers kernel "a", phase B (x10) "b": over the sum "b" wins (1 + 10 * 1 < 3 + 10 * 2).
    decode = LatencyProfile((_site("l", 0),), {"l": {"float32": _timing(5.0), "int8": _timing(
        1.0, (("a", 2.0), ("b", 1.0)))}}, {((1, 4), "float32", "int8"): 0.5})
    prefill = LatencyProfile((_site("l", 0),), {"l": {"float32": _timing(50.0, nbytes=1000), "int8": _timing(
        3.0, (("a", 3.0), ("b", 4.0)), nbytes=25)}}, {((1, 4), "float32", "int8"): 2.0}, bandwidth=10.0)
    both = workload.combine_profiles([decode, prefill], [10.0, 1.0])
    assert both.timings["l"]["int8"].kernel == "b"
    assert both.timings["l"]["int8"].tactics == (("a", 23.0), ("b", 14.0))
    assert both.timings["l"]["int8"].latency_s == 14.0
    # float32: 10 * 5 + max(50, 1000 bytes / 10 B/s) (the streaming floor of the second phase).
    assert both.timings["l"]["float32"].latency_s == 150.0
    assert both.casts == {((1, 4), "float32", "int8"): 7.0} and both.bandwidth is None
    other = LatencyProfile((_site("m", 0),), {"m": {}}, {})
    with pytest.raises(ValueError, match="phases must run the same tunable layers"):
        workload.combine_profiles([decode, other], [1.0, 1.0])


class _FakePhase(EndToEnd):
    """Rounds of fixed seconds per configuration key."""

    def __init__(self, seconds, digest):
        super().__init__(None, {}, None, "fp", digest, [])
        self.seconds = seconds

    def _time(self, configs, rounds):
        for i in range(rounds):
            self.rounds.append({self.key_of(c): self.seconds[c.name] * (1 + 0.01 * i) for c in configs})


def test_rounds_pair_weighted_totals_and_keep_each_phase():
    configs = [types.SimpleNamespace(name=n, assignment={}, kernels=(), policy_map=None) for n in ("f32", "q")]
    keys = {"f32": "k-f32", "q": "k-q"}
    fast_prefill = _FakePhase({"f32": 10.0, "q": 12.0}, "p")
    fast_decode = _FakePhase({"f32": 2.0, "q": 1.0}, "d")
    for p in (fast_prefill, fast_decode):
        p.key_of = lambda c: keys[c.name]
    both = workload.PhasedEndToEnd([fast_prefill, fast_decode], ["prefill", "decode"], [1.0, 8.0])
    both.key_of = lambda c: keys[c.name]
    both._time(configs, 3)  # pylint: disable=protected-access
    assert [round(r["k-f32"], 6) for r in both.rounds] == [26.0, 26.26, 26.52]  # 10 + 8 * 2, each x (1 + i/100)
    assert both.samples(configs[1])[0] == 20.0  # 12 + 8 * 1
    assert [(n, round(t, 9)) for n, t in both.phase_medians(configs[1])] == [("prefill", 12.12), ("decode", 1.01)]
    assert both.speedup(configs[1], configs[0]).median == pytest.approx(26.0 / 20.0)


EXPERIMENT = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from autopolicy import nn
    from autopolicy.experiment import Experiment
    from autopolicy.nn import generation

    def build(cache_dir):
        config = nn.LlamaConfig(vocab_size=256, dim=64, blocks=2, heads=4, kv_heads=2, mlp_dim=128, max_length=128)
        model = nn.LlamaDecoder(config, name="tiny").build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
        data = np.random.default_rng(1).integers(0, 256, (4, 24)).astype(np.int32)
        step = (np.ones((1, 1), np.int32), np.asarray(31, np.int32), model.init_cache(1, 32))
        return Experiment(name="tiny_lm", model=model, eval_fn=lambda m: generation.perplexity(m, data, 4),
                          sample_input=step, step_carry=generation.next_step_input, higher_is_better=False,
                          calibration_inputs=[(data[:2],)], candidates=("int8_from_float32",), max_drop=0.1,
                          workload_fn=WORKLOAD)
''')


@pytest.fixture(scope="module")
def experiments(tmp_path_factory):
    root = tmp_path_factory.mktemp("workload")
    (root / "tiny_lm.py").write_text(EXPERIMENT.replace(
        "WORKLOAD", "lambda requests: generation.workload_phases(model, requests)"))
    (root / "tiny_step.py").write_text(EXPERIMENT.replace("WORKLOAD", "None"))
    return root


def test_the_command_line_refuses_workloads_it_cannot_time(experiments, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["tune", str(experiments / "tiny_lm.py"), "--workload", "prefill=8"])
    assert "it needs both prefill= and decode=" in capsys.readouterr().err
    assert cli.main(["tune", str(experiments / "tiny_step.py"), "--workload", "prefill=8,decode=4",
                     "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--workload needs an experiment that turns requests into timed phases" in err and "'tiny_lm'" in err


@pytest.mark.slow
def test_a_tune_minimises_prefill_plus_decode(experiments, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["tune", str(experiments / "tiny_lm.py"), "--workload", "prefill=24,decode=8",
                     "--out", str(out), "--repeats", "5", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "workload: prefill 24 x1: " in printed and "; decode at 32 x8: " in printed
    summary = json.loads((out / "summary.json").read_text())
    assert [(w["phase"], w["weight"]) for w in summary["workload"]] == [("prefill 24", 1.0), ("decode at 32", 8.0)]
    assert summary["workload"][0]["inputs"][0] == [1, 24]
    for entry in [summary["chosen"], *summary["uniform"].values()]:
        if entry.get("excluded"):
            continue
        phases = entry["phases"]
        assert set(phases) == {"prefill 24", "decode at 32"}
        # The total is the median of the rounds' weighted sums: near the weighted sum of the medians.
        assert entry["measured_latency_s"] == pytest.approx(phases["prefill 24"] + 8 * phases["decode at 32"], rel=0.25)
    report = (out / "report.md").read_text()
    assert "## Workload phases" in report and "| decode at 32 (ms) |" in report.replace("  ", " ")
