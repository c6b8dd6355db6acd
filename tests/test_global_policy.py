"""The global policy and its scope."""

import threading

import pytest

import autopolicy as ap


def test_default_is_float32():
    assert ap.dtype_policy() == ap.DTypePolicy("float32")


def test_set_and_reset():
    ap.set_dtype_policy("mixed_bfloat16")
    try:
        assert ap.dtype_policy().name == "mixed_bfloat16"
        ap.set_dtype_policy(ap.QuantizedDTypePolicy("int8", "float32"))
        assert ap.dtype_policy().quantization_mode == "int8"
    finally:
        ap.set_dtype_policy("float32")


def test_scope_restores_on_exit_and_on_exception():
    with ap.policy_scope("mixed_float16") as p:
        assert p == ap.DTypePolicy("mixed_float16")
        assert ap.dtype_policy() is p
        with ap.policy_scope("bfloat16"):
            assert ap.dtype_policy().name == "bfloat16"
        assert ap.dtype_policy().name == "mixed_float16"
    assert ap.dtype_policy().name == "float32"
    with pytest.raises(RuntimeError, match="boom"):
        with ap.policy_scope("float16"):
            raise RuntimeError("boom")
    assert ap.dtype_policy().name == "float32"


def test_set_inside_a_scope_ends_with_the_scope():
    with ap.policy_scope("float16"):
        ap.set_dtype_policy("bfloat16")
        assert ap.dtype_policy().name == "bfloat16"
    assert ap.dtype_policy().name == "float32"


def test_invalid_scope_raises_before_entering():
    with pytest.raises(ValueError, match="mixed_float15"):
        with ap.policy_scope("mixed_float15"):
            pass  # pragma: no cover
    assert ap.dtype_policy().name == "float32"


def test_scope_is_local_to_its_thread():
    seen = []
    with ap.policy_scope("bfloat16"):
        t = threading.Thread(target=lambda: seen.append(ap.dtype_policy().name))
        t.start()
        t.join()
    assert seen == ["float32"]


def test_tf2_aliases():
    ap.mixed_precision.set_policy("mixed_bfloat16")
    try:
        assert ap.mixed_precision.global_policy().name == "mixed_bfloat16"
    finally:
        ap.mixed_precision.set_policy("float32")
