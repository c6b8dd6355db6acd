"""Keras-envelope JSON, both directions, files, and junk."""

import json
import os

import pytest

import autopolicy as ap

ENVELOPES = {
    "plain": (
        ap.DTypePolicy("mixed_float16"),
        {"module": "keras", "class_name": "DTypePolicy", "config": {"name": "mixed_float16"},
         "registered_name": None},
    ),
    "int8": (
        ap.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
        {"module": "keras.dtype_policies", "class_name": "QuantizedDTypePolicy",
         "config": {"mode": "int8", "source_name": "mixed_bfloat16"}, "registered_name": None},
    ),
    "float8": (
        ap.QuantizedFloat8DTypePolicy("float8", "float32"),
        {"module": "keras.dtype_policies", "class_name": "QuantizedFloat8DTypePolicy",
         "config": {"mode": "float8", "source_name": "float32", "amax_history_length": 1024},
         "registered_name": None},
    ),
}


@pytest.mark.parametrize("kind", ENVELOPES)
def test_exact_keras_envelope(kind):
    policy, expected = ENVELOPES[kind]
    out = ap.serialize(policy)
    assert out == expected
    assert list(out) == ["module", "class_name", "config", "registered_name"]
    assert json.loads(json.dumps(out)) == expected
    assert ap.deserialize(expected) == policy


def test_map_envelope():
    m = ap.DTypePolicyMap("float32", {"mlp/dense": ap.QuantizedDTypePolicy("int8", "mixed_bfloat16")})
    assert ap.serialize(m) == {
        "module": "keras.dtype_policies",
        "class_name": "DTypePolicyMap",
        "config": {"default_policy": "float32", "policy_map": {"mlp/dense": ENVELOPES["int8"][1]}},
        "registered_name": None,
    }


@pytest.mark.parametrize(
    "m",
    [
        ap.DTypePolicyMap(),
        ap.DTypePolicyMap("mixed_bfloat16", {"a": "float16", "b/.*": "int8_from_float32"}),
        ap.DTypePolicyMap(ap.QuantizedFloat8DTypePolicy("float8", "bfloat16", 7), {"x": "float64"}),
        ap.DTypePolicyMap(None, {"a": "int8_from_mixed_bfloat16", "c": "float8_from_mixed_float16"}),
    ],
    ids=repr,
)
def test_map_round_trips_through_json_every_time(m, tmp_path):
    text = json.dumps(ap.serialize(m))
    once = ap.deserialize(json.loads(text))
    assert once == m
    assert json.dumps(ap.serialize(once)) == text  # stable, not just equal
    path = tmp_path / "sub" / "map.json"
    ap.save_policy_map(m, path)
    assert ap.load_policy_map(path) == m
    assert ap.load_policy_map(str(path)) == m
    assert sorted(os.listdir(path.parent)) == ["map.json"]  # no temporary file left behind


def test_keras_null_names_resolve_to_the_global_policy():
    keras_json = {
        "module": "keras.dtype_policies",
        "class_name": "DTypePolicyMap",
        "config": {
            "default_policy": None,
            "policy_map": {
                "dense": {"module": "keras.dtype_policies", "class_name": "QuantizedDTypePolicy",
                          "config": {"mode": "int8", "source_name": None}, "registered_name": None},
                "norm": {"module": "keras", "class_name": "DTypePolicy", "config": {"name": None},
                         "registered_name": None},
            },
        },
        "registered_name": None,
    }
    with ap.policy_scope("mixed_bfloat16"):
        m = ap.deserialize(keras_json)
    assert m["dense"] == ap.QuantizedDTypePolicy("int8", "mixed_bfloat16")
    assert m["norm"] == ap.DTypePolicy("mixed_bfloat16")
    assert m.follows_global


def test_old_keras_class_names_load():
    assert ap.deserialize(
        {"module": "keras.mixed_precision", "class_name": "FloatDTypePolicy", "config": {"name": "bfloat16"}}
    ) == ap.DTypePolicy("bfloat16")
    assert ap.deserialize({"class_name": "Policy", "config": {"name": "mixed_float16"}}) == ap.DTypePolicy(
        "mixed_float16"
    )


JUNK = [
    ("a string", "dict"),
    ([1, 2], "dict"),
    ({"class_name": "Lambda", "config": {}}, "Lambda"),
    ({"class_name": "DTypePolicy", "config": {"name": "float32"}, "module": "os"}, "module='os'"),
    ({"class_name": "DTypePolicy", "config": {"name": "float32"}, "registered_name": "my>Policy"},
     "my>Policy"),
    ({"class_name": "DTypePolicy", "config": "float32"}, "config='float32'"),
    ({"class_name": "DTypePolicy", "config": {"name": "float32", "evil": 1}}, "evil"),
    ({"class_name": "DTypePolicy", "config": {"name": 5}}, "5"),
    ({"class_name": "DTypePolicy", "config": {"name": "banana"}}, "banana"),
    ({"class_name": "DTypePolicy", "config": {"name": "float32"}, "extra": 1}, "extra"),
    ({"class_name": "QuantizedDTypePolicy", "config": {"mode": "int4/128", "source_name": "float32"}},
     "Int4DTypePolicy"),
    ({"class_name": "Int4DTypePolicy", "config": {"mode": "int4/0", "source_name": "float32"}}, "block_size=0"),
    ({"class_name": "QuantizedFloat8DTypePolicy",
      "config": {"mode": "float8", "source_name": "float32", "amax_history_length": "long"}}, "long"),
    ({"class_name": "DTypePolicyMap", "config": {"default_policy": "float32", "policy_map": [1]}},
     "policy_map"),
    ({"class_name": "DTypePolicyMap", "config": {"default_policy": "float32",
                                                 "policy_map": {"a": "float99"}}}, "float99"),
]


@pytest.mark.parametrize("junk,text", JUNK, ids=[j[1] for j in JUNK])
def test_junk_raises_value_error_with_the_reason(junk, text):
    with pytest.raises(ValueError) as info:
        ap.deserialize(junk)
    assert text in str(info.value)


def test_load_policy_map_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON policy map"):
        ap.load_policy_map(bad)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not a JSON policy map"):
        ap.load_policy_map(binary)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(ap.serialize(ap.DTypePolicy("float32"))))
    with pytest.raises(ValueError, match="holds a DTypePolicy, not a DTypePolicyMap"):
        ap.load_policy_map(plain)
    with pytest.raises(FileNotFoundError):
        ap.load_policy_map(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="DTypePolicyMap"):
        ap.save_policy_map(ap.DTypePolicy("float32"), tmp_path / "x.json")


DUPLICATED = {
    # A repeated layer path, a repeated envelope key, a repeated config key: each would
    # silently keep the last value.
    "path": '{"class_name": "DTypePolicyMap", "config": {"default_policy": "float32", "policy_map": '
            '{"enc/dense": "int8_from_float32", "enc/dense": "float32"}}}',
    "envelope": '{"class_name": "DTypePolicyMap", "class_name": "DTypePolicy", "config": {}}',
    "config": '{"class_name": "DTypePolicyMap", "config": {"default_policy": "float32", '
              '"default_policy": "bfloat16", "policy_map": {}}}',
}


@pytest.mark.parametrize("case", list(DUPLICATED))
def test_a_map_file_with_a_duplicate_key_is_refused(tmp_path, case):
    path = tmp_path / "map.json"
    path.write_text(DUPLICATED[case])
    with pytest.raises(ValueError) as info:
        ap.load_policy_map(path)
    key = {"path": "'enc/dense'", "envelope": "'class_name'", "config": "'default_policy'"}[case]
    assert f"duplicate key {key}" in str(info.value) and "map.json" in str(info.value)


def test_a_map_file_nested_too_deeply_is_refused(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="deep.json.*nests too deeply"):
        ap.load_policy_map(path)


@pytest.mark.parametrize("path", [3, 3.5, b"map.json", None, ["map.json"]])
def test_policy_map_paths_must_be_str_or_pathlike(tmp_path, path):
    with pytest.raises(TypeError) as info:
        ap.load_policy_map(path)
    assert f"path={path!r} of type {type(path).__name__}" in str(info.value)
    with pytest.raises(TypeError) as info:
        ap.save_policy_map(ap.DTypePolicyMap("float32"), path)
    assert f"path={path!r}" in str(info.value)


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "map.json"
    ap.save_policy_map(ap.DTypePolicyMap("float32", {"a": "bfloat16"}), path)
    original = path.read_text()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        ap.save_policy_map(ap.DTypePolicyMap("float16"), path)
    monkeypatch.undo()
    assert path.read_text() == original
    assert sorted(os.listdir(tmp_path)) == ["map.json"]


def test_saved_files_get_normal_permissions(tmp_path):
    path = tmp_path / "map.json"
    ap.save_policy_map(ap.DTypePolicyMap("float32"), path)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
