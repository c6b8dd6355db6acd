"""The adapter seam: a model that is not an autopolicy module (a plain function of a params dict
holding two matmuls) is tuned through an adapter defined here; the search imports no framework."""

import ast
import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopolicy import policies, search
from autopolicy.search import adapter as adapter_module
from autopolicy.search.adapter import Program, TunableLayer


@dataclasses.dataclass(frozen=True)
class TwoMatmuls:
    """``relu(x @ w1) @ w2`` with a params dict; each matmul runs in its own compute dtype."""

    params: dict
    dtypes: tuple = ("float32", "float32")

    def __call__(self, x):
        d1, d2 = (jnp.dtype(d) for d in self.dtypes)
        h = jax.nn.relu(x.astype(d1) @ self.params["w1"].astype(d1))
        return (h.astype(d2) @ self.params["w2"].astype(d2)).astype(jnp.float32)


def _matmul(w, x):
    return x @ w.astype(x.dtype)


class TwoMatmulsAdapter:
    """The whole adapter a framework needs: seven methods."""

    PATHS = ("w1", "w2")

    def __init__(self, model, sample_args, calibration):
        self.model = model
        x = sample_args[0]
        self.inputs = {"w1": x, "w2": jax.nn.relu(x @ model.params["w1"])}

    def layers(self):
        return tuple(TunableLayer(p, "matmul", (), f"matmul{self.model.params[p].shape}x{self.inputs[p].shape}",
                                  self.inputs[p].shape, None if p == "w1" else "w1") for p in self.PATHS)

    def layer_program(self, path, policy):
        x = self.inputs[path].astype(policy.compute_dtype)
        return Program(_matmul, (x,), self.model.params[path])

    def layer_bytes(self, path, policy):
        return int(self.model.params[path].size * jnp.dtype(policy.variable_dtype).itemsize)

    def complete_map(self, assignment):
        return policies.DTypePolicyMap("float32", {p: n for p, n in assignment.items() if n != "float32"})

    def with_policies(self, policy_map):
        return TwoMatmuls(self.model.params, tuple(policy_map[p].compute_dtype for p in self.PATHS))

    def model_program(self, model):
        return Program(lambda params, x: TwoMatmuls(params, model.dtypes)(x), (self.inputs["w1"],), model.params)

    def weights_digest(self):
        return adapter_module.digest_arrays(self.model.params)


# NumPy draws, copied over: nothing compiles when the module is imported (every pytest-xdist
# worker imports it while collecting).
_RNG = np.random.default_rng(0)
PARAMS = {"w1": jax.device_put((_RNG.standard_normal((64, 128)) / 8).astype(np.float32)),
          "w2": jax.device_put((_RNG.standard_normal((128, 16)) / 11).astype(np.float32))}
X = jax.device_put(_RNG.standard_normal((256, 64)).astype(np.float32))


@functools.cache
def _reference():
    return np.asarray(TwoMatmuls(PARAMS)(X))


def fidelity(model):
    """1 - relative error of the outputs against float32 (1.0 exactly for float32)."""
    out, reference = np.asarray(model(X)), _reference()
    return 1.0 - float(np.linalg.norm(out - reference) / np.linalg.norm(reference))


def test_a_zero_budget_keeps_every_layer_in_float32():
    result = search.tune(TwoMatmuls(PARAMS), fidelity, X, candidates=["float32", "mixed_bfloat16"],
                         max_drop=0.0, relative=False, repeats=3, progress=False,
                         adapter=TwoMatmulsAdapter, profile_accuracy="always")
    assert list(result.profile["layer"].unique()) == ["w1", "w2"]
    assert result.profile.shape[0] == 4  # 2 layers x 2 policies
    costs = result.profile.set_index(["layer", "policy"])["accuracy_cost"]
    assert 1e-4 < costs["w1", "mixed_bfloat16"] < 2e-2 and 1e-4 < costs["w2", "mixed_bfloat16"] < 2e-2
    assert dict(result.policy_map.items()) == {} and result.chosen.name == "uniform float32"
    assert isinstance(result.model, TwoMatmuls) and result.model.dtypes == ("float32", "float32")
    assert result.summary["chosen"]["metric"] == 1.0


def test_a_registered_adapter_tunes_the_users_model_and_returns_its_kind(monkeypatch):
    monkeypatch.setattr(adapter_module, "_REGISTRY", list(adapter_module._REGISTRY))
    search.register_adapter(TwoMatmuls, TwoMatmulsAdapter)
    result = search.tune(TwoMatmuls(PARAMS), fidelity, X, candidates=["float32", "mixed_bfloat16"],
                         max_drop=0.05, relative=False, repeats=3, progress=False, min_speedup=1.0)
    # Every configuration's metric is the user's metric of the model the adapter built for it.
    for config in result.configurations:
        if config.metric is not None:
            dtypes = tuple(config.policy_map[p].compute_dtype for p in ("w1", "w2"))
            assert config.metric == pytest.approx(fidelity(TwoMatmuls(PARAMS, dtypes)), abs=1e-6)
    assert result.chosen.meets_budget and isinstance(result.model, TwoMatmuls)
    assert result.model.dtypes == tuple(result.policy_map[p].compute_dtype for p in ("w1", "w2"))
    assert {c.uniform for c in result.configurations if c.kind == "uniform"} == {"float32", "mixed_bfloat16"}


def test_an_unknown_model_type_names_the_remedy():
    with pytest.raises(TypeError, match=r"No model adapter for a builtins\.dict.*register_adapter"):
        search.tune({"w": jnp.ones((2, 2))}, fidelity, X, progress=False)


def test_an_adapter_without_the_protocols_methods_is_refused():
    class Partial:
        def __init__(self, model, sample_args, calibration):
            pass

        def layers(self):
            return ()

    with pytest.raises(TypeError, match=r"lacks the methods \['layer_program', 'layer_bytes'"):
        search.tune(TwoMatmuls(PARAMS), fidelity, X, progress=False, adapter=Partial)


def test_nothing_under_search_imports_a_framework():
    root = pathlib.Path(search.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("autopolicy.nn", "keras", "flax", "autopolicy.adapters")), (path, name)


def test_identical_nn_layers_of_different_blocks_are_timed_once(monkeypatch):
    from autopolicy import nn
    from autopolicy.search import profiling, timing
    from autopolicy.search.cache import MeasurementCache

    blocks = [nn.Sequential([nn.Dense(32, activation="relu", name="query")], name=f"block_{i}") for i in range(3)]
    model = nn.Sequential(blocks + [nn.Dense(8)], name="net").build(jax.random.key(0), jnp.ones((4, 32)))
    made = search.get_adapter(model, (jnp.ones((4, 32)),), [])
    sites = profiling.sites(made.layers(), [policies.get("float32"), policies.get("mixed_bfloat16")])
    assert len({s.layer.signature for s in sites}) == 2  # three equal "query" layers, one head
    timed = []
    real = timing.measure
    monkeypatch.setattr(timing, "measure", lambda todo, **kw: timed.append(len(todo)) or real(todo, **kw))
    latency = profiling.measure_latency(made, sites, MeasurementCache(None), "fingerprint", repeats=3)
    assert timed[:2] == [2, 2] and sum(timed) - timed[-1] == 4  # block_0's layer and the head; then casts
    assert latency.timing("net/block_2/query", "float32") == latency.timing("net/block_0/query", "float32")
    assert latency.bandwidth is None  # 13 KB of weights stay cached between calls: no streaming floor


@pytest.mark.slow
def test_the_streaming_floor_applies_to_models_larger_than_the_last_level_cache(monkeypatch):
    from autopolicy import nn
    from autopolicy.search import hardware, profiling
    from autopolicy.search.cache import MeasurementCache

    ids = jnp.asarray([[3, 1, 4, 1]], jnp.int32)
    model = nn.Sequential([nn.Embedding(512, 64, name="embed"), nn.Dense(256, name="up"), nn.Dense(64, name="down")],
                          name="lm").build(jax.random.key(0), ids)
    made = search.get_adapter(model, (ids,), [])
    assert [t.gather for t in made.layers()] == [True, False, False]
    sites = profiling.sites(made.layers(), [policies.get("float32"), policies.get("int8_from_float32")])
    streamed = (64 * 256 + 256 + 256 * 64 + 64) * 4  # the two Dense layers' float32 kernels and biases
    seen = []
    monkeypatch.setattr(profiling, "stream_bandwidth", lambda nbytes, *a: seen.append(nbytes) or 10e9)
    monkeypatch.setattr(hardware, "cache_bytes", lambda platform_name="cpu": streamed - 1)  # one byte too small
    cache = MeasurementCache(None)
    latency = profiling.measure_latency(made, sites, cache, "fingerprint", repeats=3)
    assert seen == [streamed] and latency.bandwidth == 10e9  # the embedding's table is not streamed
    up = latency.sites[1]
    assert latency.latency_s(up, "float32") == max(latency.timing("lm/up", "float32").latency_s, 66560 / 10e9)
    monkeypatch.setattr(hardware, "cache_bytes", lambda platform_name="cpu": streamed)
    assert profiling.measure_latency(made, sites, cache, "fingerprint", repeats=3).bandwidth is None  # timings cached


def test_the_stream_bandwidth_is_measured_once_per_machine_and_size():
    from autopolicy.search import profiling
    from autopolicy.search.cache import MeasurementCache

    cache = MeasurementCache(None)
    first = profiling.stream_bandwidth(3 << 20, cache, "fingerprint", repeats=3)  # reads 64 MiB
    assert 1e8 < first < 1e13 and cache.misses == 1  # between 100 MB/s and 10 TB/s
    assert profiling.stream_bandwidth(60 << 20, cache, "fingerprint", repeats=3) == first and cache.misses == 1


def test_the_last_level_cache_is_the_largest_cache_sysfs_lists(monkeypatch, tmp_path):
    from autopolicy.search import hardware

    for i, size in enumerate(("48K", "64K", "2048K", "491520K")):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    real_glob = hardware.glob.glob
    monkeypatch.setattr(hardware.glob, "glob", lambda pattern: real_glob(str(tmp_path / "index*" / "size")))
    assert hardware.cache_bytes() == 491520 * 1024
    assert hardware.cache_bytes("gpu") == 64 << 20
    monkeypatch.setattr(hardware.glob, "glob", lambda pattern: [])
    assert hardware.cache_bytes() == 32 << 20
