"""Kernel tactics of the Keras adapter: the int8 product of a Keras Dense or EinsumDense runs
the int8 kernel the search chose (the same accumulators bit for bit); float8 is left out for a
layer fed integer ids, as in the autopolicy.nn adapter."""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    keras = pytest.importorskip("keras")

from autopolicy import policies  # noqa: E402
from autopolicy.adapters import _keras_kernels  # noqa: E402
from autopolicy.adapters.keras import KerasAdapter  # noqa: E402
from autopolicy.numerics import kernels  # noqa: E402
from autopolicy.search.adapter import supports_kernels  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")
layers = keras.layers
INT8 = policies.get("int8_from_float32")
IDS = np.random.default_rng(0).integers(0, 32, (4, 8)).astype(np.int32)


@pytest.fixture(autouse=True)
def _keras_promotion():
    with jax.numpy_dtype_promotion("standard"):  # Keras relies on JAX's standard promotion
        yield


@pytest.fixture(scope="module")
def adapter():
    keras.utils.set_random_seed(0)
    ids = keras.Input((8,), dtype="int32", name="ids")
    x = layers.Embedding(32, 16, name="embed")(ids)
    x = layers.Dense(16, activation="relu", name="up")(x)
    x = layers.Conv1D(16, 3, padding="same", name="conv")(x)
    x = layers.EinsumDense("bsd,df->bsf", output_shape=(8, 12), bias_axes="f", name="mlp")(x)
    ints = layers.Dense(4, name="on_ids")(ids)  # token ids straight into a Dense
    model = keras.Model(ids, [x, ints], name="net")
    with jax.numpy_dtype_promotion("standard"):
        return KerasAdapter(model, (IDS,), [])


def _uses_uint8(program):
    text = str(jax.make_jaxpr(program.fn)(program.state, *program.args))
    return "u8[" in text


def test_dense_and_einsum_dense_offer_the_int8_kernels_of_this_device(adapter):
    assert supports_kernels(adapter)  # the search times each layer's kernels, as for autopolicy.nn
    expected = kernels.candidate_kernels("int8", "einsum")
    assert adapter.layer_kernels("up", INT8) == expected
    assert adapter.layer_kernels("mlp", INT8) == expected
    # One kernel: Keras's own call (a convolution, a gather, a float policy, float8's emulation).
    assert adapter.layer_kernels("conv", INT8) == ()
    assert adapter.layer_kernels("embed", INT8) == ()
    assert adapter.layer_kernels("up", policies.DTypePolicy("mixed_bfloat16")) == ()
    assert adapter.layer_kernels("up", policies.get("float8_from_float32")) == ()


def test_float8_is_no_candidate_for_a_layer_fed_integers(adapter):
    modes = {layer.path: layer.modes for layer in adapter.layers()}
    assert "float8" not in modes["embed"]  # token ids
    assert "float8" not in modes["on_ids"]  # token ids straight into a Dense
    assert modes["up"] == ("int8", "float8", "int4")  # floats from the embedding


@pytest.mark.parametrize("path", ["up", "mlp"])
def test_every_kernel_gives_the_same_outputs_as_keras_own_int8_call(adapter, path):
    own = adapter.layer_program(path, INT8)
    reference = np.asarray(jax.jit(own.fn)(own.state, *own.args))
    assert not _uses_uint8(own)
    for name in adapter.layer_kernels(path, INT8):
        program = adapter.layer_program(path, INT8, kernel=name)
        out = np.asarray(jax.jit(program.fn)(program.state, *program.args))
        np.testing.assert_array_equal(out, reference)  # exact kernels: the same int32 accumulators
        assert _uses_uint8(program) == (name == "u8s8"), name  # the product really is that kernel


def test_a_kernel_the_layer_cannot_run_is_refused_naming_the_valid_ones(adapter):
    with pytest.raises(ValueError, match=r"Invalid kernel for 'conv' under 'int8_from_float32'\. "
                                         r"Expected one of \(\)\. Received: kernel='u8s8'"):
        adapter.layer_program("conv", INT8, kernel="u8s8")
    with pytest.raises(ValueError, match="Invalid int8 kernel. Expected one of"):
        with _keras_kernels.kernel_scope("vnni"):
            pass


@pytest.mark.slow  # 5-10 s on a 2-core EPYC
def test_chosen_kernels_run_in_the_models_the_adapter_hands_out(adapter):
    if "u8s8" not in adapter.layer_kernels("up", INT8):
        pytest.skip("this device times one int8 kernel only")
    policy_map = adapter.complete_map({"up": INT8, "mlp": INT8})
    plain = adapter.with_policies(policy_map)
    adapter.use_kernels({"up": {INT8.name: "u8s8"}, "mlp": {"mixed_bfloat16": "u8s8"}})
    try:
        chosen = adapter.with_policies(policy_map)
    finally:
        adapter.use_kernels({})
    by_path = {layer.path: layer for layer in chosen._flatten_layers(include_self=False)}
    assert getattr(by_path["up"], "autopolicy_kernel", None) == "u8s8"
    assert getattr(by_path["mlp"], "autopolicy_kernel", None) is None  # chosen for another policy
    program = adapter.model_program(chosen)
    assert _uses_uint8(program) and not _uses_uint8(adapter.model_program(plain))
    for a, b in zip(chosen(IDS), plain(IDS)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_outside_a_scope_keras_own_int8_matmul_runs():
    a = jnp.array([[3, -4]], jnp.int8)
    b = jnp.array([[2], [1]], jnp.int8)
    _keras_kernels.install()
    assert _keras_kernels.active_kernel() is None
    out = keras.ops.matmul(a, b)
    assert out.dtype == jnp.int32 and out.tolist() == [[2]]
    with _keras_kernels.kernel_scope("u8s8"):
        assert _keras_kernels.active_kernel() == "u8s8"
        assert keras.ops.matmul(a, b).tolist() == [[2]]
        assert keras.ops.einsum("mk,kn->mn", a, b).tolist() == [[2]]
        assert keras.ops.matmul(a.astype(jnp.float32), b.astype(jnp.float32)).dtype == jnp.float32
    assert _keras_kernels.active_kernel() is None
