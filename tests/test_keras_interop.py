"""What we write loads in Keras, and what Keras writes loads here (Keras with the JAX backend)."""

import json
import os
import warnings

import pytest

import autopolicy as ap

os.environ.setdefault("KERAS_BACKEND", "jax")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    keras = pytest.importorskip("keras")
kdp = keras.dtype_policies

POLICIES = [
    ap.DTypePolicy("mixed_float16"),
    ap.DTypePolicy("bfloat16"),
    ap.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
    ap.QuantizedFloat8DTypePolicy("float8", "float32", 16),
]


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_ours_load_in_keras(policy):
    theirs = kdp.deserialize(json.loads(json.dumps(ap.serialize(policy))))
    assert type(theirs).__name__ == type(policy).__name__
    assert theirs.name == policy.name
    assert (theirs.compute_dtype, theirs.variable_dtype) == (policy.compute_dtype, policy.variable_dtype)
    assert kdp.serialize(theirs) == ap.serialize(policy)


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_keras_policies_load_here(policy):
    theirs = getattr(kdp, type(policy).__name__).from_config(policy.get_config())
    assert ap.deserialize(json.loads(json.dumps(kdp.serialize(theirs)))) == policy


def _keras_map(default):
    return kdp.DTypePolicyMap(
        default,
        {
            "mlp/dense": kdp.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
            "mlp/dense_[0-9]": kdp.DTypePolicy("mixed_float16"),
            "head": kdp.QuantizedFloat8DTypePolicy("float8", "float32"),
        },
    )


@pytest.mark.parametrize("default", ["float32", "mixed_bfloat16"])
def test_maps_cross_both_ways(default):
    ours = ap.deserialize(json.loads(json.dumps(kdp.serialize(_keras_map(default)))))
    assert ours["mlp/dense"] == ap.QuantizedDTypePolicy("int8", "mixed_bfloat16")
    assert ours["mlp/dense_3"] == ap.DTypePolicy("mixed_float16")
    assert ours["mlp/other"] == ap.DTypePolicy(default)
    back = kdp.deserialize(json.loads(json.dumps(ap.serialize(ours))))
    assert back["mlp/dense_3"].name == "mixed_float16"
    assert back["head"].name == "float8_from_float32"
    assert back.default_policy.name == default
    assert ap.serialize(ours) == kdp.serialize(_keras_map(default))


def test_keras_null_default_map_loads():
    keras_json = json.loads(json.dumps(kdp.serialize(_keras_map(None))))
    with ap.policy_scope("mixed_bfloat16"):
        ours = ap.deserialize(keras_json)
    assert ours["mlp/dense"] == ap.QuantizedDTypePolicy("int8", "mixed_bfloat16")
    assert ours["head"] == ap.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16")
    assert ours.follows_global


def test_file_written_here_loads_in_keras(tmp_path):
    path = tmp_path / "map.json"
    ap.save_policy_map(ap.DTypePolicyMap("float32", {"enc/.*/query": "int8_from_float32"}), path)
    theirs = kdp.deserialize(json.loads(path.read_text()))
    assert theirs["enc/block_0/query"].name == "int8_from_float32"
