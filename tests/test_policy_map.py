"""DTypePolicyMap lookups, mutation rules and value semantics."""

import copy
import pickle

import pytest

import autopolicy as ap

BF16 = ap.DTypePolicy("mixed_bfloat16")
INT8 = ap.QuantizedDTypePolicy("int8", "float32")
F16 = ap.DTypePolicy("float16")


def test_exact_key_beats_regex():
    m = ap.DTypePolicyMap("float32", {"mlp/dense.*": BF16, "mlp/dense_1": INT8})
    assert m["mlp/dense_1"] == INT8
    assert m["mlp/dense_2"] == BF16


def test_regex_is_full_match_not_prefix_or_search():
    m = ap.DTypePolicyMap("float32", {"dense": BF16, "block_[0-9]/mlp": INT8})
    assert m["dense"] == BF16
    assert m["dense_1"] == ap.DTypePolicy("float32")  # prefix only
    assert m["mlp/dense"] == ap.DTypePolicy("float32")  # re.search would match
    assert m["block_3/mlp"] == INT8
    assert m["block_3/mlp/dense"] == ap.DTypePolicy("float32")


def test_several_regex_matches_raise_with_the_path_and_keys():
    m = ap.DTypePolicyMap("float32", {"enc/.*": BF16, ".*/query": INT8})
    with pytest.raises(ValueError) as info:
        m["enc/query"]
    assert "enc/query" in str(info.value)
    assert "enc/.*" in str(info.value) and ".*/query" in str(info.value)


def test_default_fallback_and_default_following_the_global():
    fixed = ap.DTypePolicyMap(F16)
    follows = ap.DTypePolicyMap()
    assert fixed["anything"] == F16 and follows["anything"] == ap.DTypePolicy("float32")
    with ap.policy_scope("mixed_bfloat16"):
        assert follows["anything"] == BF16  # resolved at lookup, not construction
        assert follows.compute_dtype == "bfloat16"
        assert fixed["anything"] == F16
    assert follows.follows_global and not fixed.follows_global


def test_the_map_acts_as_its_default_policy():
    m = ap.DTypePolicyMap("mixed_float16", {"a": INT8})
    assert (m.compute_dtype, m.variable_dtype) == ("float16", "float32")
    assert m.quantization_mode is None and m.should_cast_variables
    assert m.name == "map_mixed_float16"


def test_insertion_order_len_contains_del_pop():
    m = ap.DTypePolicyMap("float32")
    for key in ["c", "a", "b"]:
        m[key] = "bfloat16"
    assert list(m) == ["c", "a", "b"] and len(m) == 3
    assert "a" in m and "z" not in m and ".*" not in m
    del m["a"]
    assert list(m) == ["c", "b"]
    assert m.pop("c") == ap.DTypePolicy("bfloat16")
    assert m.pop("nope", None) is None
    with pytest.raises(KeyError):
        m.pop("nope")
    with pytest.raises(KeyError):
        del m["nope"]
    assert list(m.items()) == [("b", ap.DTypePolicy("bfloat16"))]


def test_duplicate_keys_raise_instead_of_overwriting():
    m = ap.DTypePolicyMap("float32", {"a": BF16})
    with pytest.raises(ValueError, match="'a' already has a policy"):
        m["a"] = INT8
    assert m["a"] == BF16


@pytest.mark.parametrize(
    "value,stored",
    [
        ("int8_from_float32", INT8),
        (INT8, INT8),
        ({"class_name": "DTypePolicy", "config": {"name": "float16"}}, F16),
        ({"module": "keras", "class_name": "DTypePolicy", "config": {"name": "float16"},
          "registered_name": None}, F16),
    ],
)
def test_values_are_converted(value, stored):
    m = ap.DTypePolicyMap("float32")
    m["x"] = value
    assert m["x"] == stored


@pytest.mark.parametrize(
    "key,value,exc,text",
    [
        ("x", "mixed_float15", ValueError, "mixed_float15"),
        ("x", 12, ValueError, "12"),
        ("x", ap.DTypePolicyMap("float32"), ValueError, "another map"),
        ("", "float32", ValueError, "key=''"),
        (3, "float32", ValueError, "key=3"),
        ("dense[", "float32", ValueError, "dense["),
    ],
)
def test_bad_keys_and_values(key, value, exc, text):
    m = ap.DTypePolicyMap("float32")
    with pytest.raises(exc) as info:
        m[key] = value
    assert text in str(info.value)
    assert len(m) == 0


def test_constructor_validation():
    with pytest.raises(ValueError, match="cannot be a DTypePolicyMap"):
        ap.DTypePolicyMap(ap.DTypePolicyMap("float32"))
    with pytest.raises(TypeError, match="policy_map must be a dict"):
        ap.DTypePolicyMap("float32", [("a", "float32")])
    with pytest.raises(ValueError, match="banana"):
        ap.DTypePolicyMap("banana")


def test_unused_keys_catches_typos():
    m = ap.DTypePolicyMap("float32", {"mlp/dense": BF16, "mlp/dnese_1": INT8, "mlp/.*_2": F16})
    assert m.unused_keys(["mlp/dense", "mlp/dense_1", "mlp/dense_2"]) == ["mlp/dnese_1"]
    assert m.unused_keys([]) == ["mlp/dense", "mlp/dnese_1", "mlp/.*_2"]


def test_matching_keys():
    m = ap.DTypePolicyMap("float32", {"a/.*": BF16, "a/b": INT8})
    assert m.matching_keys("a/b") == ["a/b"]
    assert m.matching_keys("a/c") == ["a/.*"]
    assert m.matching_keys("z") == []


def test_get_config_never_mutates_the_stored_policies():
    m = ap.DTypePolicyMap(None, {"a": INT8, "b": BF16})
    before = list(m.items())
    config = m.get_config()
    assert config["default_policy"] is None
    assert config["policy_map"]["a"]["config"] == {"mode": "int8", "source_name": "float32"}
    assert list(m.items()) == before
    assert m["a"].source_name == "float32"


@pytest.mark.parametrize("default", [None, "mixed_float16", INT8])
def test_copy_deepcopy_pickle_round_trips(default):
    m = ap.DTypePolicyMap(default, {"a": INT8, "b/.*": BF16})
    for other in (copy.copy(m), copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert other == m
        assert other["b/x"] == BF16
    deep = copy.deepcopy(m)
    deep["c"] = F16
    assert "c" not in m


def test_maps_are_not_hashable():
    with pytest.raises(TypeError):
        hash(ap.DTypePolicyMap())


def test_equality():
    assert ap.DTypePolicyMap("float32", {"a": BF16}) == ap.DTypePolicyMap("float32", {"a": "mixed_bfloat16"})
    assert ap.DTypePolicyMap("float32") != ap.DTypePolicyMap(None)
    assert ap.DTypePolicyMap("float32", {"a": BF16, "b": F16}) != ap.DTypePolicyMap(
        "float32", {"b": F16, "a": BF16}
    )  # order is part of a map


def test_repr():
    m = ap.DTypePolicyMap("float32", {"a": INT8})
    assert repr(m) == "<DTypePolicyMap default_policy=float32, mapping=[('a', 'int8_from_float32')]>"
