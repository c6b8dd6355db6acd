"""The digits_cnn_nnx experiment: a Flax NNX CNN (nnx.Conv, max pooling, nnx.Linear) on the
digits images, tuned through the Flax adapter; and the convolution pitfalls of Qwix 0.1.8 that
the adapter stands between. Runs only where the `flax` extra is installed (its tier)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax", reason="the flax extra is not installed: pip install -e '.[flax]'")
qwix = pytest.importorskip("qwix", reason="the flax extra is not installed: pip install -e '.[flax]'")
from flax import nnx  # noqa: E402

from autopolicy import datasets, experiment, policies, search  # noqa: E402
from autopolicy.adapters import flax as af  # noqa: E402

pytestmark = pytest.mark.flax

PATHS = ["conv1", "conv2", "hidden", "logits"]
MIN_ACCURACY = 0.95  # the float model's validation accuracy; digits_cnn (autopolicy.nn) reaches ~0.98


@pytest.fixture(autouse=True)
def _standard_promotion():
    """Qwix 0.1.8's int8 path needs JAX's default promotion (see tests/test_flax_adapter.py)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="module")
def mod():
    return experiment.load("digits_cnn_nnx")


@pytest.fixture(scope="module")
def exp(mod, tmp_path_factory):
    with jax.numpy_dtype_promotion("standard"):
        return mod.build(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def x(exp):
    return exp.sample_input[:32]


def test_layers_in_execution_order(exp):
    adapter = af.FlaxAdapter(exp.model, (exp.sample_input,), [])
    assert [(l.path, l.kind, l.modes) for l in adapter.layers()] == [
        ("conv1", "Conv", ("int8", "float8")), ("conv2", "Conv", ("int8", "float8")),
        ("hidden", "Linear", ("int8", "int4", "float8")), ("logits", "Linear", ("int8", "int4", "float8"))]
    assert adapter.layers()[0].input_shape == (256, 8, 8, 1)


@pytest.mark.slow  # 5-10 s on a 2-core EPYC
def test_trained_float_model_is_accurate_and_cached(mod, exp, tmp_path):
    assert exp.eval_fn(exp.model) > MIN_ACCURACY
    assert exp.test_fn(exp.model) > MIN_ACCURACY
    data = datasets.digits(seed=0, image=True)
    mod._save(exp.model, tmp_path / mod.CACHE_NAME / "weights.npz")
    again = mod.cached_model(tmp_path, data)  # read back, not trained
    np.testing.assert_array_equal(np.asarray(again.hidden.kernel[...]), np.asarray(exp.model.hidden.kernel[...]))
    (tmp_path / mod.CACHE_NAME / "weights.npz").write_bytes(b"garbled")
    with pytest.warns(UserWarning, match="is damaged"):
        mod.cached_model(tmp_path, data)


def test_build_without_flax_names_the_install(mod, monkeypatch):
    monkeypatch.setattr(mod, "nnx", None)
    with pytest.raises(ModuleNotFoundError, match=r'pip install -e "\.\[flax\]"'):
        mod.build("unused")


@pytest.mark.slow
def test_tune_gives_convs_only_the_modes_qwix_runs_on_convs(exp):
    result = search.tune(exp.model, eval_fn=exp.eval_fn, sample_input=exp.sample_input, max_drop=exp.max_drop,
                         calibration_inputs=exp.calibration_inputs, repeats=3, progress=False)
    entries = dict(result.policy_map.items())
    assert set(entries) <= set(PATHS)
    for path in ("conv1", "conv2"):
        mode = policies.get(entries.get(path, "float32")).quantization_mode
        assert mode in (None, "int8", "float8"), (path, entries.get(path))
    tuned = af.apply_policy_map(exp.model, result.policy_map, exp.sample_input)
    assert exp.eval_fn(tuned) >= exp.eval_fn(exp.model) - exp.max_drop


def test_a_layer_of_a_quantized_model_cannot_be_called_alone_quantized_layer_can(exp, x):
    """Qwix quantizes the ops inside the tuned model's own call: a submodule called directly meets
    Qwix's quantized parameters (WithAux) in plain Flax code. `quantized_layer` is the way."""
    tuned = af.apply_policy_map(exp.model, {"conv1": "int8_from_float32"}, x)
    assert tuned(x).shape == (32, 10)
    assert type(tuned.conv1.kernel).__name__ == "WithAux"
    with pytest.raises(ValueError, match="setting an array element with a sequence"):  # qwix 0.1.8, flax 0.12.8
        tuned.conv1(x)
    layer = af.quantized_layer(exp.model, "conv1", "int8_from_float32", x)
    inside = af.record_calls(tuned, x)["conv1"].output  # conv1's output within the tuned model's call
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(inside), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(layer(x)), np.asarray(exp.model.conv1(x)), rtol=0, atol=1e-6)
    assert af.quantized_layer(exp.model, "hidden", "mixed_bfloat16")(jnp.ones((2, 1024))).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"'conv9' is not a tunable layer of the model: .*\['conv1', 'conv2'"):
        af.quantized_layer(exp.model, "conv9", "int8_from_float32", x)
    with pytest.raises(ValueError, match=r"Quantizing 'conv1' to 'int8_from_float32' needs sample_args"):
        af.quantized_layer(exp.model, "conv1", "int8_from_float32")


def test_qwix_refuses_a_weight_only_or_int4_conv_the_adapter_never_asks(exp, x):
    """Qwix 0.1.8 quantizes a convolution only with the same type for inputs and weights."""
    for fields in ({"weight_qtype": jnp.int8}, {"weight_qtype": jnp.int4, "act_qtype": jnp.int8}):
        provider = qwix.PtqProvider([qwix.QuantizationRule(module_path="conv1", **fields)])
        with pytest.raises(ValueError, match="conv_general_dilated requires same act_qtype and weight_qtype"):
            af._quantize(nnx.clone(exp.model), provider, x)
    adapter = af.FlaxAdapter(exp.model, (x,), [])
    for mode in adapter.layers()[0].modes:  # the conv's modes: every rule quantizes both to one type
        fields = af.rule_fields("conv1", f"{mode}_from_float32")
        assert fields["act_qtype"] == fields["weight_qtype"]
    for policy in ("int4_from_float32", "int4/32_from_float32"):
        with pytest.raises(ValueError, match=rf"'conv1' \(Conv\) cannot run '{policy}' \(Qwix quantizes a "
                                             r"convolution's inputs and weights to one type.*float policy"):
            af.apply_policy_map(exp.model, {"conv1": policy}, x)
