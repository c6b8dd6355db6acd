"""Tuning a user's Keras 3 model (JAX backend): the adapter, apply_policy_map, save and reload."""

import os
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    keras = pytest.importorskip("keras")

import autopolicy.keras as apk  # noqa: E402
from autopolicy import policies, search  # noqa: E402
from autopolicy.adapters import _keras_layers, _keras_models  # noqa: E402
from autopolicy.search import timing  # noqa: E402

layers = keras.layers
# Keras 3.15's own quantize converts its variables with np.array(), which NumPy 2 warns about.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
VOCAB, SEQ, DIM = 64, 16, 16
IDS = np.random.default_rng(0).integers(0, VOCAB, (32, SEQ)).astype(np.int32)
HELD_OUT = np.random.default_rng(1).integers(0, VOCAB, (64, SEQ)).astype(np.int32)


@pytest.fixture(autouse=True)
def _keras_promotion():
    # Keras mixes bfloat16 and float32 operands (a bfloat16 query meets a float32 key) and relies
    # on JAX's standard promotion; the suite's strict default would refuse Keras's own code.
    with jax.numpy_dtype_promotion("standard"):
        yield


def functional_model():
    """Embedding, Conv2D, MultiHeadAttention, LayerNormalization, EinsumDense and Dense."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    x = layers.Embedding(VOCAB, DIM, name="embed")(ids)
    x = layers.Reshape((4, 4, DIM))(x)
    x = layers.Conv2D(DIM, 3, padding="same", activation="relu", name="conv")(x)
    x = layers.Reshape((SEQ, DIM))(x)
    x = layers.LayerNormalization(name="norm")(x + layers.MultiHeadAttention(2, 8, name="attn")(x, x))
    x = layers.EinsumDense("bsd,df->bsf", output_shape=(SEQ, 32), bias_axes="f", activation="relu", name="mlp")(x)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, layers.Dense(5, name="head")(x), name="net")


def snapshot(model):
    return ([np.array(w.value) for w in model.weights],
            [(layer.path, layer.dtype_policy.name) for layer in model._flatten_layers(include_self=False)])


def assert_same_snapshot(a, b):
    assert a[1] == b[1]
    assert len(a[0]) == len(b[0])
    for x, y in zip(a[0], b[0]):
        np.testing.assert_array_equal(x, y)


def policies_by_path(model):
    return {layer.path: _keras_layers.own_policy(layer).name
            for layer in model._flatten_layers(include_self=False) if layer.path}


# --- the adapter -------------------------------------------------------------------------------

def test_import_autopolicy_does_not_import_keras():
    code = "import sys, autopolicy, autopolicy.search; print('keras' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_public_name_of_autopolicy_keras_exists():
    assert apk.__all__ == ["apply_policy_map", "policy_map_of", "save", "load", "ARCHIVE_MEMBER"]
    assert all(getattr(apk, name) is not None for name in apk.__all__)


def test_int4_policies_reach_keras_quantize_with_their_block_size():
    kdp = keras.dtype_policies
    keras.utils.set_random_seed(1)
    for policy, name, has_zero in ((kdp.QuantizedDTypePolicy("int4", "float32"), "int4_from_float32", False),
                                   (kdp.Int4DTypePolicy("int4/128", "float32"), "int4/128_from_float32", True)):
        dense = layers.Dense(8)
        dense.build((None, 256))
        assert _keras_layers.set_layer_policy(dense, policy) == name
        assert hasattr(dense, "kernel_zero") == has_zero and dense._kernel.shape == (256, 4)  # two nibbles a byte
    assert _keras_layers.canonical_name(kdp.Int4DTypePolicy("int4/-1", "float32")) == "int4_from_float32"


@pytest.mark.slow
def test_tunable_layers_in_execution_order_with_inputs_modes_and_producers():
    made = search.get_adapter(functional_model(), (IDS,), [])
    rows = [(t.path, t.kind, t.modes, t.input_shape, t.producer) for t in made.layers()]
    assert [t.path for t in made.layers() if t.gather] == ["embed"]  # reads one row per id, not its table
    assert rows == [
        ("embed", "Embedding", ("int8", "int4"), (32, SEQ), None),
        ("conv", "Conv2D", (), (32, 4, 4, DIM), None),  # a Reshape sits between them
        ("attn/query", "EinsumDense", ("int8", "float8", "int4"), (32, SEQ, DIM), None),
        ("attn/key", "EinsumDense", ("int8", "float8", "int4"), (32, SEQ, DIM), None),
        ("attn/value", "EinsumDense", ("int8", "float8", "int4"), (32, SEQ, DIM), None),
        ("attn/attention_output", "EinsumDense", ("int8", "float8", "int4"), (32, SEQ, 2, 8), None),
        ("mlp", "EinsumDense", ("int8", "float8", "int4"), (32, SEQ, DIM), "norm"),
        ("head", "Dense", ("int8", "float8", "int4"), (32, 32), None),
    ]


def test_a_keras_dense_under_int8_via_the_adapter_matches_keras_own_quantized_dense_exactly():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((24,)), layers.Dense(40, name="d")], name="seq")
    x = np.random.default_rng(2).standard_normal((16, 24)).astype(np.float32)
    made = search.get_adapter(model, (x,), [])
    ours = np.asarray(made.layer_program("seq/d", policies.get("int8_from_float32")).run())
    theirs = layers.Dense.from_config(model.get_layer("d").get_config())
    theirs.build((None, 24))
    theirs.set_weights([w.value for w in model.get_layer("d").weights])
    theirs.quantize("int8")
    expected = np.asarray(theirs(x))
    np.testing.assert_array_equal(ours, expected)
    assert theirs.dtype_policy.name == "int8_from_float32"
    float32 = x @ np.asarray(model.get_layer("d").kernel) + np.asarray(model.get_layer("d").bias)
    assert 1e-4 < np.abs(ours - float32).max() < 5e-2  # really quantized, and close


def test_a_mixed_bfloat16_layer_program_computes_in_bfloat16():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((24,)), layers.Dense(40, name="d")], name="seq")
    x = np.random.default_rng(2).standard_normal((16, 24)).astype(np.float32)
    made = search.get_adapter(model, (x,), [])
    program = made.layer_program("seq/d", policies.get("mixed_bfloat16"))
    out = program.run()
    assert out.dtype == np.dtype("bfloat16") and program.args[0][0].dtype == np.dtype("bfloat16")
    reference = layers.Dense.from_config({**model.get_layer("d").get_config(), "dtype": "mixed_bfloat16"})
    reference.build((None, 24))
    reference.set_weights([w.value for w in model.get_layer("d").weights])
    expected = jax.jit(lambda a: reference(a))(x)  # Keras's own autocasting __call__, jitted
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    assert made.layer_bytes("seq/d", policies.get("mixed_bfloat16")) == (24 * 40 + 40) * 4


@pytest.mark.slow
def test_attention_projections_refuse_float16_where_keras_attention_cannot_compile_it():
    made = search.get_adapter(functional_model(), (IDS,), [])
    float16 = policies.get("mixed_float16")
    compiles = _keras_layers.float16_attention_compiles()  # False on XLA:CPU (no f16 x f16 -> f32 dot)
    assert {t.path: t.supports(float16) for t in made.layers()} == {
        "embed": True, "conv": True, "attn/query": compiles, "attn/key": compiles, "attn/value": compiles,
        "attn/attention_output": True, "mlp": True, "head": True}
    assert made.layers()[2].supports(policies.get("int8_from_float32"))
    # Every layer on float16 where it supports it: the whole model compiles.
    uniform = made.with_policies(made.complete_map({t.path: "mixed_float16" for t in made.layers() if t.supports(float16)}))
    program = made.model_program(uniform)
    assert jax.jit(program.fn).lower(program.state, *program.args).compile() is not None


def test_layer_bytes_follow_keras_storage():
    made = search.get_adapter(functional_model(), (IDS,), [])
    assert made.layer_bytes("embed", policies.get("float32")) == VOCAB * DIM * 4
    assert made.layer_bytes("embed", policies.get("int8_from_float32")) == VOCAB * DIM + VOCAB * 4
    assert made.layer_bytes("head", policies.get("int8_from_float32")) == 32 * 5 + 5 * 4 + 5 * 4


def test_the_adapter_refuses_a_quantized_model():
    model = functional_model()
    model.get_layer("head").quantize("int8")
    with pytest.raises(ValueError, match=r"Tune the float model.*\['head'\]"):
        search.get_adapter(model, (IDS,), [])


def test_the_adapter_runs_a_model_copy_whose_program_matches_keras_jitted():
    model = functional_model()
    made = search.get_adapter(model, (IDS,), [])
    tuned = made.with_policies(made.complete_map({"attn/query": "int8_from_float32", "mlp": "mixed_bfloat16"}))
    program = made.model_program(tuned)
    np.testing.assert_array_equal(np.asarray(program.run(), np.float32),
                                  np.asarray(jax.jit(lambda a: tuned(a))(IDS), np.float32))


def test_complete_map_lets_a_norm_follow_the_layer_it_reads():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), layers.Dense(8, name="a"), layers.LayerNormalization(name="ln"),
                              layers.Dense(4, name="b")], name="chain")
    made = search.get_adapter(model, (np.ones((2, 8), np.float32),), [])
    assert [(t.path, t.producer) for t in made.layers()] == [("chain/a", None), ("chain/b", "chain/ln")]
    follow = made.complete_map({"chain/a": "int8_from_mixed_bfloat16", "chain/b": "float32"})
    assert {p: v.name for p, v in follow.items()} == {"chain/a": "int8_from_mixed_bfloat16",
                                                     "chain/ln": "mixed_bfloat16"}
    assert dict(made.complete_map({"chain/b": "mixed_bfloat16"}).items()) == {"chain/b": policies.get("mixed_bfloat16")}
    assert dict(made.complete_map({"chain/a": "int8_from_float32"}).items()) == {
        "chain/a": policies.get("int8_from_float32")}  # float32 hands on float32


# --- fake clock: a program costs its weight and input bytes, so decisions are deterministic --

class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def process_time(self):
        return self.now


def _cost(candidate):
    leaves = jax.tree_util.tree_leaves((candidate.state, candidate.inputs))
    return 1e-9 * sum(np.asarray(x).nbytes for x in leaves if hasattr(x, "dtype")) + 1e-6


@pytest.fixture
def fake_clock(monkeypatch):
    clock = _FakeClock()

    def compile_loop(candidate, inner=None, unroll=None):
        cost = _cost(candidate)

        def run(count=None):
            clock.now += cost * (1 if count is None else int(count))

        return run

    monkeypatch.setattr(timing, "compile_loop", compile_loop)
    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(timing, "_cpu_seconds", clock.process_time)
    return clock


def fidelity(reference):
    def eval_fn(model):
        out = np.asarray(model(HELD_OUT), np.float32)
        return 1.0 - float(np.linalg.norm(out - reference) / np.linalg.norm(reference))

    return eval_fn


@pytest.mark.slow
def test_done_when_tune_apply_save_reload_gives_the_same_outputs(fake_clock, tmp_path):
    model = functional_model()
    before = snapshot(model)
    result = search.tune(model, fidelity(np.asarray(model(HELD_OUT))), IDS,
                         candidates=["float32", "mixed_bfloat16", "int8_from_float32"], max_drop=0.05,
                         relative=False, repeats=3, progress=False, confirm_seconds=0.0)
    assert_same_snapshot(before, snapshot(model))  # the user's model is never modified
    chosen = {path: policy.name for path, policy in result.policy_map.items()}
    assert "int8_from_float32" in chosen.values(), chosen  # int8 weights cost fewer bytes
    assert set(chosen) <= set(policies_by_path(model))
    tuned = result.model
    assert isinstance(tuned, keras.Model)
    assert _keras_models.mismatches(tuned, result.policy_map) == []  # every layer runs its map policy
    expected = np.asarray(tuned(IDS))
    again = apk.apply_policy_map(model, result.policy_map)
    np.testing.assert_array_equal(np.asarray(again(IDS)), expected)

    apk.save(tuned, tmp_path / "tuned.keras")
    np.testing.assert_array_equal(np.asarray(apk.load(tmp_path / "tuned.keras")(IDS)), expected)
    tuned.save(tmp_path / "native.keras")
    native = keras.saving.load_model(tmp_path / "native.keras")
    np.testing.assert_array_equal(np.asarray(native(IDS)), expected)
    assert policies_by_path(native) == policies_by_path(tuned)


# --- apply_policy_map ----------------------------------------------------------------------------

def test_apply_sets_each_leaf_policy_and_leaves_the_original_alone():
    model = functional_model()
    before = snapshot(model)
    tuned = apk.apply_policy_map(model, {"embed": "int8_from_float32", "attn/(query|key)": "mixed_bfloat16",
                                         "attn/value": "int8_from_mixed_bfloat16", "head": "int8_from_float32",
                                         "norm": "int8_from_float32"})
    assert_same_snapshot(before, snapshot(model))
    got = policies_by_path(tuned)
    assert (got["embed"], got["attn/query"], got["attn/key"], got["attn/value"], got["head"]) == (
        "int8_from_float32", "mixed_bfloat16", "mixed_bfloat16", "int8_from_mixed_bfloat16", "int8_from_float32")
    assert got["norm"] == "float32"  # no int8 kernel: the source policy
    assert got["conv"] == got["mlp"] == got["attn/attention_output"] == got["attn"] == "float32"
    assert tuned.get_layer("head")._kernel.dtype == "int8"
    assert tuned.get_layer("attn")._query_dense(np.ones((1, 2, DIM), np.float32)).dtype == "bfloat16"
    assert apk.policy_map_of(tuned)["attn/key"] == policies.get("mixed_bfloat16")


def test_predict_on_a_copy_leaves_the_originals_weights_alive():
    model = functional_model()
    expected = np.asarray(model(IDS))
    tuned = apk.apply_policy_map(model, {})
    tuned.predict(IDS, verbose=0)  # Keras's jitted predict step donates the copy's variable buffers
    np.testing.assert_array_equal(np.asarray(model(IDS)), expected)
    np.testing.assert_array_equal(np.asarray(tuned(IDS)), expected)


def test_a_float_policy_with_another_variable_dtype_retypes_the_weights():
    model = functional_model()
    tuned = apk.apply_policy_map(model, {"conv": "bfloat16"})
    conv = tuned.get_layer("conv")
    assert [v.dtype for v in conv.weights] == ["bfloat16", "bfloat16"]
    np.testing.assert_array_equal(np.asarray(conv.kernel, np.float32),
                                  np.asarray(model.get_layer("conv").kernel).astype("bfloat16").astype(np.float32))


def test_unused_keys_warn_by_name_and_raise_when_strict():
    model = functional_model()
    with pytest.warns(UserWarning, match=r"match no layer path of 'net': \['attn/querry'\]"):
        apk.apply_policy_map(model, {"attn/querry": "mixed_bfloat16", "head": "mixed_bfloat16"})
    with pytest.raises(ValueError, match=r"\['hea'\]"):
        apk.apply_policy_map(model, {"hea": "mixed_bfloat16"}, strict=True)  # keys match whole paths


def test_a_keras_policy_map_is_accepted():
    kdp = keras.dtype_policies
    kmap = kdp.DTypePolicyMap("float32", {"attn/.*": kdp.DTypePolicy("mixed_bfloat16")})
    got = policies_by_path(apk.apply_policy_map(functional_model(), kmap))
    assert {p: n for p, n in got.items() if n != "float32"} == {
        "attn/query": "mixed_bfloat16", "attn/key": "mixed_bfloat16", "attn/value": "mixed_bfloat16",
        "attn/attention_output": "mixed_bfloat16"}


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"Expected a keras.Model. Received: builtins.dict"):
        apk.apply_policy_map({}, {})
    with pytest.raises(TypeError, match=r"policy_map must be .*Received: list"):
        apk.apply_policy_map(functional_model(), ["head"])
    with pytest.raises(ValueError, match=r"'net2' is not built"):
        apk.apply_policy_map(keras.Sequential([layers.Dense(2)], name="net2"), {})


def test_float8_scales_are_calibrated_from_the_inputs():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((24,)), layers.Dense(40, name="d")], name="seq")
    x = 3.0 * np.random.default_rng(2).standard_normal((16, 24)).astype(np.float32)
    tuned = apk.apply_policy_map(model, {"seq/d": "float8_from_float32"}, calibration_inputs=[x])
    dense = tuned.get_layer("d")
    np.testing.assert_allclose(float(dense.inputs_scale.value), np.abs(x).max() / 448.0, rtol=1e-6)
    np.testing.assert_allclose(float(dense.kernel_scale.value),
                               np.abs(np.asarray(model.get_layer("d").kernel)).max() / 448.0, rtol=1e-6)
    error = np.abs(np.asarray(tuned(x)) - np.asarray(model(x))).max() / np.abs(np.asarray(model(x))).max()
    assert 1e-4 < error < 0.1


# --- saving --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_keras_loses_quantized_attention_sublayers_on_reload_and_our_route_keeps_them(tmp_path):
    plain = functional_model()
    with pytest.warns(UserWarning, match="does not have a `quantize` method"):
        plain.quantize("int8")  # Keras's own
    plain.save(tmp_path / "plain.keras")
    with pytest.raises(ValueError, match="expected 2 variables, but received 0"):
        keras.saving.load_model(tmp_path / "plain.keras")

    paths = [t.path for t in search.get_adapter(functional_model(), (IDS,), []).layers() if t.modes]
    tuned = apk.apply_policy_map(functional_model(), {p: "int8_from_float32" for p in paths} | {
        "attn/value": "mixed_bfloat16"})
    tuned.save(tmp_path / "tuned.keras")
    reloaded = keras.saving.load_model(tmp_path / "tuned.keras")
    assert policies_by_path(reloaded)["attn/query"] == "int8_from_float32"
    assert policies_by_path(reloaded)["attn/value"] == "mixed_bfloat16"
    np.testing.assert_array_equal(np.asarray(reloaded(IDS)), np.asarray(tuned(IDS)))


@keras.saving.register_keras_serializable("autopolicy_tests")
class TwoBlocks(keras.Model):
    """A subclassed model: its layers get automatic names when it is made again from config."""

    def __init__(self, width=16, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Embedding(VOCAB, width)
        self.attn = layers.MultiHeadAttention(2, 8)
        self.head = layers.Dense(3)

    def call(self, ids):
        x = self.embed(ids)
        return self.head(self.attn(x, x))

    def get_config(self):
        return {**super().get_config(), "width": 16}


def test_a_subclassed_model_is_tuned_by_its_own_paths_and_reloads_through_autopolicy(tmp_path):
    keras.utils.set_random_seed(0)
    model = TwoBlocks(name="blocks")
    expected_float = np.asarray(model(IDS))
    attn, head = f"blocks/{model.attn.name}", f"blocks/{model.head.name}"  # automatic names
    paths = [t.path for t in search.get_adapter(model, (IDS,), []).layers()]
    assert paths == [f"blocks/{model.embed.name}", f"{attn}/query", f"{attn}/key", f"{attn}/value",
                     f"{attn}/attention_output", head]
    layers.Dense(3)  # shifts Keras's automatic names: a copy made now gets other names
    tuned = apk.apply_policy_map(model, {head: "int8_from_float32", f"{attn}/key": "int8_from_float32"}, strict=True)
    assert policies_by_path(tuned)[head] == "int8_from_float32"
    assert policies_by_path(tuned)[f"{attn}/key"] == "int8_from_float32"
    out = np.asarray(tuned(IDS))
    assert 0 < np.abs(out - expected_float).max() < 0.05
    apk.save(tuned, tmp_path / "sub.keras")
    np.testing.assert_array_equal(np.asarray(apk.load(tmp_path / "sub.keras")(IDS)), out)
    with pytest.raises(ValueError, match="could not be loaded"):  # Keras alone rebuilds float layers
        keras.saving.load_model(tmp_path / "sub.keras")


def test_int4_maps_apply_save_and_reload(tmp_path):
    model = functional_model()
    tuned = apk.apply_policy_map(model, {"mlp": "int4/8_from_float32", "embed": "int4_from_float32",
                                         "attn/key": "int4_from_float32"})
    got = policies_by_path(tuned)
    assert (got["mlp"], got["embed"], got["attn/key"]) == ("int4/8_from_float32", "int4_from_float32",
                                                           "int4_from_float32")
    assert tuned.get_layer("mlp").kernel_zero.shape == (2, 32)  # 16 inputs in blocks of 8, per output
    out = np.asarray(tuned(IDS))
    assert 0 < np.abs(out - np.asarray(model(IDS))).max() < 0.1
    apk.save(tuned, tmp_path / "int4.keras")
    np.testing.assert_array_equal(np.asarray(apk.load(tmp_path / "int4.keras")(IDS)), out)
    tuned.save(tmp_path / "native.keras")
    np.testing.assert_array_equal(np.asarray(keras.saving.load_model(tmp_path / "native.keras")(IDS)), out)


def test_save_refuses_a_model_that_does_not_run_the_map(tmp_path):
    model = functional_model()
    with pytest.raises(ValueError, match="No policy map is known for 'net'"):
        apk.save(model, tmp_path / "m.keras")
    with pytest.raises(ValueError, match=r"does not run the policy map.*\('head', 'float32', 'int8_from_float32'\)"):
        apk.save(model, tmp_path / "m.keras", {"head": "int8_from_float32"})


def test_load_reads_a_plain_keras_file(tmp_path):
    model = functional_model()
    model.save(tmp_path / "plain.keras")
    np.testing.assert_array_equal(np.asarray(apk.load(tmp_path / "plain.keras")(IDS)), np.asarray(model(IDS)))
