"""Policy names, dtypes, modes, reprs, errors, and value semantics."""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopolicy as ap
from autopolicy.policies import _names

PLAIN = [
    # name, compute, variable
    ("float16", "float16", "float16"),
    ("bfloat16", "bfloat16", "bfloat16"),
    ("float32", "float32", "float32"),
    ("float64", "float64", "float64"),
    ("mixed_float16", "float16", "float32"),
    ("mixed_bfloat16", "bfloat16", "float32"),
    ("int32", "int32", "int32"),
    ("uint8", "uint8", "uint8"),
    ("bool", "bool", "bool"),
]
SOURCES = ["float16", "bfloat16", "float32", "float64", "mixed_float16", "mixed_bfloat16"]
INT8_SOURCES = [s for s in SOURCES if "float16" not in s or "bfloat16" in s]


@pytest.mark.parametrize("name,compute,variable", PLAIN)
def test_plain_policy(name, compute, variable):
    p = ap.DTypePolicy(name)
    assert (p.name, p.compute_dtype, p.variable_dtype) == (name, compute, variable)
    assert p.quantization_mode is None
    assert p.should_cast_variables == (compute != variable)
    assert repr(p) == f'<DTypePolicy "{name}">'
    assert str(p) == repr(p)
    assert ap.get(name) == p


@pytest.mark.parametrize("source", INT8_SOURCES)
def test_int8_policy(source):
    p = ap.QuantizedDTypePolicy("int8", source)
    src = ap.DTypePolicy(source)
    assert p.name == f"int8_from_{source}"
    assert (p.compute_dtype, p.variable_dtype) == (src.compute_dtype, src.variable_dtype)
    assert p.quantization_mode == "int8" and p.source_name == source
    assert repr(p) == f'<QuantizedDTypePolicy "int8_from_{source}">'
    assert ap.get(p.name) == p
    assert isinstance(p, ap.DTypePolicy)


@pytest.mark.parametrize("source", SOURCES)
def test_float8_policy(source):
    p = ap.QuantizedFloat8DTypePolicy("float8", source)
    src = ap.DTypePolicy(source)
    assert p.name == f"float8_from_{source}"
    assert (p.compute_dtype, p.variable_dtype) == (src.compute_dtype, src.variable_dtype)
    assert p.quantization_mode == "float8" and p.amax_history_length == 1024
    assert repr(p) == f'<QuantizedFloat8DTypePolicy "float8_from_{source}">'
    assert ap.get(p.name) == p


def test_import_example_from_the_issue():
    assert str(ap.QuantizedDTypePolicy("int8", "mixed_bfloat16")) == (
        '<QuantizedDTypePolicy "int8_from_mixed_bfloat16">'
    )


def test_float_dtype_policy_is_an_alias():
    p = ap.FloatDTypePolicy("float32")
    assert p == ap.DTypePolicy("float32")
    assert repr(p) == '<DTypePolicy "float32">'
    assert ap.FloatDTypePolicy is ap.DTypePolicy


INVALID = [
    # constructor, args, exception, text that must appear
    (ap.DTypePolicy, ("",), ValueError, "name=''"),
    (ap.DTypePolicy, ("mixed_float15",), ValueError, "mixed_float15"),
    (ap.DTypePolicy, ("float7",), ValueError, "float7"),
    (ap.DTypePolicy, ("int8",), ValueError, "int8_from_float32"),
    (ap.get, ("int8",), ValueError, "int8_from_float32"),
    (ap.get, ("float8",), ValueError, "float8_from_float32"),
    (ap.get, ("int8_from_",), ValueError, "source_name=''"),
    (ap.get, ("int8_from_mixed_float16",), ValueError, "int8_from_mixed_float16"),
    (ap.get, ("int8_from_float16",), ValueError, "float16"),
    (ap.get, ("int7_from_float32",), ValueError, "int7_from_float32"),
    (ap.get, ("int8_from_int8_from_float32",), ValueError, "int8_from_float32"),
    (ap.get, ("int8_from_int32",), ValueError, "int32"),
    (ap.get, (7,), ValueError, "7"),
    (ap.get, ([1, 2],), ValueError, "[1, 2]"),
    (ap.get, (object,), ValueError, "object"),
    (ap.DTypePolicy, (32,), TypeError, "32"),
    (ap.DTypePolicy, (np.float32,), TypeError, "float32"),
    (ap.DTypePolicy, ("int8_from_float32",), ValueError, "int8_from_float32"),
    (ap.QuantizedDTypePolicy, ("int7", "float32"), ValueError, "int7"),
    (ap.QuantizedDTypePolicy, ("float8", "float32"), ValueError, "QuantizedFloat8DTypePolicy"),
    (ap.QuantizedDTypePolicy, ("int8", "mixed_float16"), ValueError, "mixed_float16"),
    (ap.QuantizedDTypePolicy, ("int8", 3), TypeError, "source_name=3"),
    (ap.QuantizedDTypePolicy, ("int8", "int8_from_float32"), ValueError, "int8_from_float32"),
    (ap.QuantizedFloat8DTypePolicy, ("int8", "float32"), ValueError, "mode='int8'"),
    (ap.QuantizedFloat8DTypePolicy, ("float8", "float32", 2.5), TypeError, "2.5"),
    (ap.QuantizedFloat8DTypePolicy, ("float8", "float32", True), TypeError, "True"),
    (ap.QuantizedFloat8DTypePolicy, ("float8", "float32", 0), ValueError, "0"),
    # A typo's length would die much later, deep inside JAX: refused with the bound.
    (ap.QuantizedFloat8DTypePolicy, ("float8", "float32", 10**30), ValueError, f"between 1 and {2**20}"),
    (ap.QuantizedFloat8DTypePolicy, ("float8", "float32", 10**30), ValueError, f"={10**30}"),
    (ap.QuantizedFloat8DTypePolicy, ("float8", "float32", 2**20 + 1), ValueError, f"={2**20 + 1}"),
    (ap.get, ([],), ValueError, "Received: []"),  # not NumPy's reading of it ('void')
    (ap.get, ({1},), ValueError, "Received: {1}"),
    (ap.get, (np.dtype([("a", "f4")]),), ValueError, "dtype([('a', '<f4')])"),
    (ap.set_dtype_policy, (None,), ValueError, "None"),
    (ap.set_dtype_policy, ("banana",), ValueError, "banana"),
    (ap.set_dtype_policy, (ap.DTypePolicyMap("float32"),), ValueError, "DTypePolicyMap"),
]


@pytest.mark.parametrize("fn,args,exc,text", INVALID, ids=[repr(i[1]) for i in INVALID])
def test_invalid_inputs(fn, args, exc, text):
    with pytest.raises(exc) as info:
        fn(*args)
    assert text in str(info.value)


def test_amax_history_length_bounds_are_accepted():
    assert ap.QuantizedFloat8DTypePolicy("float8", "float32", 2**20).amax_history_length == 2**20
    assert ap.QuantizedFloat8DTypePolicy("float8", "float32", 1).amax_history_length == 1
    assert ap.QuantizedFloat8DTypePolicy().amax_history_length == 1024


def test_the_void_reading_is_gone():
    with pytest.raises(ValueError) as info:
        ap.get([])
    assert "void" not in str(info.value)


def test_invalid_name_lists_the_valid_forms():
    with pytest.raises(ValueError) as info:
        ap.DTypePolicy("mixed_float15")
    for valid in _names.FLOAT_DTYPES + tuple(_names.MIXED_POLICIES) + _names.QUANTIZATION_MODES:
        assert valid in str(info.value)


def test_every_suggested_example_is_accepted():
    for mode in _names.QUANTIZATION_MODES:
        with pytest.raises(ValueError) as info:
            ap.get(mode)
        suggestion = str(info.value).split("e.g. '")[1].split("'")[0]
        assert ap.get(suggestion).quantization_mode == mode
    with pytest.raises(ValueError) as info:
        ap.get("int8_from_mixed_float16")
    assert ap.get("int8_from_mixed_bfloat16").name in str(info.value)
    with pytest.raises(ValueError) as info:
        ap.DTypePolicy("int8")
    assert "int8_from_float32" in str(info.value)


def test_none_means_the_global_policy():
    with ap.policy_scope("mixed_bfloat16"):
        assert ap.DTypePolicy().name == "mixed_bfloat16"
        assert ap.DTypePolicy(None).compute_dtype == "bfloat16"
        assert ap.QuantizedDTypePolicy("int8").name == "int8_from_mixed_bfloat16"
        assert ap.QuantizedFloat8DTypePolicy().name == "float8_from_mixed_bfloat16"
        assert ap.get(None) == ap.DTypePolicy("mixed_bfloat16")
    with ap.policy_scope("int8_from_float32"):
        # A quantized global policy contributes its source to non-quantized constructions.
        assert ap.DTypePolicy().name == "float32"
        assert ap.QuantizedFloat8DTypePolicy().name == "float8_from_float32"


def test_amax_history_length_accepts_numpy_ints():
    assert ap.QuantizedFloat8DTypePolicy("float8", "float32", np.int64(16)).amax_history_length == 16


def test_get_config_and_from_config():
    assert ap.DTypePolicy("mixed_float16").get_config() == {"name": "mixed_float16"}
    q = ap.QuantizedDTypePolicy("int8", "float32")
    assert q.get_config() == {"mode": "int8", "source_name": "float32"}
    f = ap.QuantizedFloat8DTypePolicy("float8", "bfloat16", 8)
    assert f.get_config() == {"mode": "float8", "source_name": "bfloat16", "amax_history_length": 8}
    for p in (ap.DTypePolicy("float64"), q, f):
        assert type(p).from_config(p.get_config()) == p


ALL_POLICIES = [
    ap.DTypePolicy("mixed_float16"),
    ap.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
    ap.QuantizedFloat8DTypePolicy("float8", "float32", 16),
]


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=repr)
def test_value_semantics(policy):
    assert copy.copy(policy) == policy
    assert copy.deepcopy(policy) == policy
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert hash(pickle.loads(pickle.dumps(policy))) == hash(policy)
    assert {policy: 1}[type(policy).from_config(policy.get_config())] == 1
    with pytest.raises(AttributeError):
        policy.name = "float32"


def test_equality_is_by_class_and_fields():
    assert ap.DTypePolicy("float32") != ap.QuantizedDTypePolicy("int8", "float32")
    assert ap.QuantizedFloat8DTypePolicy("float8", "float32", 8) != ap.QuantizedFloat8DTypePolicy(
        "float8", "float32", 16
    )
    assert ap.DTypePolicy("float32") != "float32"
    assert len({ap.DTypePolicy("float32"), ap.get("float32"), ap.DTypePolicy("bfloat16")}) == 2


def test_policy_is_a_static_jit_argument():
    traces = []

    def cast(x, policy):
        traces.append(policy)
        return x.astype(policy.compute_dtype)

    f = jax.jit(cast, static_argnums=1)
    x = jnp.arange(3.0)
    assert f(x, ap.DTypePolicy("bfloat16")).dtype == jnp.bfloat16
    assert f(x, ap.DTypePolicy("bfloat16")).dtype == jnp.bfloat16
    assert f(x, ap.get("mixed_float16")).dtype == jnp.float16
    assert len(traces) == 2  # equal policies hit the cache


@pytest.mark.parametrize(
    "value,autocast,dtype,expected",
    [
        (np.ones(3, np.float32), True, "bfloat16", "bfloat16"),
        (np.ones(3, np.float32), False, "bfloat16", "float32"),
        (np.arange(3, dtype=np.int32), True, "bfloat16", "int32"),
        (np.array([True]), True, "float16", "bool"),
        (jnp.ones(3, jnp.float16), True, "float32", "float32"),
        (jnp.ones(3, jnp.bfloat16), True, "bfloat16", "bfloat16"),
    ],
)
def test_convert_input(value, autocast, dtype, expected):
    out = ap.DTypePolicy("float32").convert_input(value, autocast, dtype)
    assert np.dtype(out.dtype).name == expected
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(value, np.float32))


def test_convert_input_passes_python_scalars_through():
    assert ap.DTypePolicy("float16").convert_input(1.5, True, "float16") == 1.5


def test_get_accepts_dtypes_and_configs():
    assert ap.get(jnp.bfloat16) == ap.DTypePolicy("bfloat16")
    assert ap.get(np.dtype("float64")) == ap.DTypePolicy("float64")
    assert ap.get({"class_name": "DTypePolicy", "config": {"name": "float16"}}) == ap.DTypePolicy("float16")
    p = ap.QuantizedDTypePolicy("int8", "float32")
    assert ap.get(p) is p
    m = ap.DTypePolicyMap()
    assert ap.get(m) is m


def test_dtype_policies_alias_module():
    assert ap.dtype_policies.DTypePolicy is ap.policies.DTypePolicy
    assert set(ap.dtype_policies.__all__) == set(ap.policies.__all__)
