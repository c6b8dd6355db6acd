"""A strict numerics harness: warnings are errors (pyproject), silent upcasts fail, no global
policy leaks from one test into another."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import pytest  # noqa: E402

import autopolicy as ap  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True)
def _no_leaked_global_policy():
    assert ap.dtype_policy() == ap.DTypePolicy("float32"), "a previous test leaked a global policy"
    yield
    leaked = ap.dtype_policy()
    ap.set_dtype_policy("float32")
    assert leaked == ap.DTypePolicy("float32"), f"the test leaked the global policy {leaked!r}"
