"""Saving and loading models (float, quantized, float8, custom composites), without pickle."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy as ap
import autopolicy.nn as nn

X = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 8)), jnp.float32)


class Block(nn.Module):
    def __init__(self, dim, heads, **kwargs):
        super().__init__(**kwargs)
        self.norm = nn.LayerNormalization()
        self.attention = nn.MultiHeadAttention(heads, dim // heads)
        self.mlp = nn.Sequential([nn.Dense(2 * dim, activation="gelu"), nn.Dense(dim)])

    def call(self, x):
        h = self.norm(x)
        return x + self.cast(self.attention(h, h)) + self.cast(self.mlp(h))


def model():
    return nn.Sequential([Block(8, 2), nn.Dense(3)], name="net").build(jax.random.key(0), X)


MAP = ap.DTypePolicyMap(
    "float32",
    {
        "net/block/attention/query": "int8_from_mixed_bfloat16",
        "net/block/mlp/dense.*": "float8_from_float32",
        "net/dense": "bfloat16",
    },
)


def test_round_trip_keeps_outputs_policies_and_dtypes(tmp_path):
    original = nn.calibrate(model().with_dtype_policy(MAP), [X])
    nn.save(original, tmp_path)
    loaded = nn.load(tmp_path, custom_objects={"Block": Block})
    np.testing.assert_array_equal(np.asarray(loaded(X), np.float32), np.asarray(original(X), np.float32))
    for (pa, a), (pb, b) in zip(original.layers_by_path().items(), loaded.layers_by_path().items()):
        assert pa == pb and a.dtype_policy == b.dtype_policy
    assert loaded.layers[0].attention.query_dense.kernel.dtype == jnp.int8
    assert loaded.layers[1].kernel.dtype == jnp.bfloat16
    fp8 = loaded.layers[0].mlp.layers[0].fp8["input"]
    np.testing.assert_array_equal(fp8.amax_history, original.layers[0].mlp.layers[0].fp8["input"].amax_history)
    assert float(fp8.scale) != 1.0  # calibrated
    manifest = json.loads((tmp_path / "model.json").read_text())
    assert manifest["policy_map"]["class_name"] == "DTypePolicyMap"


def test_a_decoder_built_from_its_config_object_round_trips(tmp_path):
    config = nn.LlamaConfig(vocab_size=64, dim=16, blocks=1, heads=4, kv_heads=2, mlp_dim=32, rope_base=500.0)
    model = nn.LlamaDecoder(config, name="lm").build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    nn.save(model, tmp_path / "m")
    loaded = nn.load(tmp_path / "m")
    assert loaded.config == config and type(loaded.config) is nn.LlamaConfig
    ids = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(model(ids)))


def test_unknown_custom_class_needs_registration(tmp_path):
    nn.save(model(), tmp_path)
    with pytest.raises(ValueError, match="register_serializable"):
        nn.load(tmp_path)


def test_lambda_arguments_cannot_be_saved(tmp_path):
    m = nn.Dense(2, activation=lambda x: x).build(jax.random.key(0), jnp.ones((1, 3)))
    assert m(jnp.ones((1, 3))).shape == (1, 2)
    with pytest.raises(ValueError, match="JSON"):
        nn.save(m, tmp_path)


def test_unbuilt_models_and_junk_files(tmp_path):
    with pytest.raises(ValueError, match="built"):
        nn.save(nn.Dense(2), tmp_path)
    (tmp_path / "model.json").write_text("not json")
    with pytest.raises(ValueError, match="not JSON"):
        nn.load(tmp_path)
    (tmp_path / "model.json").write_text(json.dumps({"format": "pickle"}))
    with pytest.raises(ValueError, match="not an autopolicy model"):
        nn.load(tmp_path)


def test_a_model_file_with_a_duplicate_key_is_refused(tmp_path):
    nn.save(nn.Dense(2).build(jax.random.key(0), X), tmp_path)
    text = (tmp_path / "model.json").read_text()
    # A weight's dtype twice: the last one would win without a word.
    assert text.count('"dtypes": {') == 1
    (tmp_path / "model.json").write_text(text.replace('"dtypes": {', '"dtypes": {".kernel": "bfloat16", '))
    with pytest.raises(ValueError, match="model.json.*duplicate key '.kernel'"):
        nn.load(tmp_path)


@pytest.mark.parametrize("directory", [3, None])
def test_save_and_load_take_paths_only(directory):
    with pytest.raises(TypeError, match=f"directory={directory!r} of type {type(directory).__name__}"):
        nn.load(directory)
    with pytest.raises(TypeError, match=f"directory={directory!r}"):
        nn.save(nn.Dense(2).build(jax.random.key(0), X), directory)


def test_weights_that_do_not_match_raise(tmp_path):
    nn.save(nn.Dense(2).build(jax.random.key(0), jnp.ones((1, 3))), tmp_path / "a")
    nn.save(nn.Dense(3).build(jax.random.key(0), jnp.ones((1, 3))), tmp_path / "b")
    (tmp_path / "a" / "weights.npz").write_bytes((tmp_path / "b" / "weights.npz").read_bytes())
    with pytest.raises(ValueError, match="kernel"):
        nn.load(tmp_path / "a")


@pytest.mark.slow
def test_layers_made_while_building_keep_their_saved_policies(tmp_path):
    """A LlamaDecoder's output and down projections are made by build (their sizes come from the
    call): a map applied before building missed them, and a saved GPTQ one did not load."""
    import dataclasses

    from autopolicy.nn.weight_calibration import calibrate_weights

    config = nn.LlamaConfig(vocab_size=40, dim=24, blocks=2, heads=6, kv_heads=2, mlp_dim=32, rope_base=100.0)
    model = nn.LlamaDecoder(dataclasses.asdict(config), name="tiny").build(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 16)), jnp.int32)
    policy_map = ap.DTypePolicyMap("float32", {"tiny/block_0/attention/attention_output": "gptq/8/-1_from_float32",
                                               "tiny/block_1/mlp/down": "int8_from_float32"})
    tuned = calibrate_weights(model.with_dtype_policy(policy_map), [(ids,)])
    nn.save(tuned, tmp_path)
    loaded = nn.load(tmp_path)
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(tuned(ids)))
    layers = loaded.layers_by_path()
    assert layers["tiny/block_0/attention/attention_output"].dtype_policy.name == "gptq/8/-1_from_float32"
    assert layers["tiny/block_1/mlp/down"].kernel.dtype == jnp.int8
