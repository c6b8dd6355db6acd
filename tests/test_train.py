"""The fit/evaluate loop on real data (scikit-learn's digits)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopolicy.nn as nn
from autopolicy import train
from helpers import digits

# Each test trains or tunes (a module fixture alone takes ~20 s on two cores): run with the full
# suite, left out of the quick loop `pytest -m "not slow"`.
pytestmark = pytest.mark.slow



def digits_mlp(dtype=None):
    return nn.Sequential(
        [nn.Dense(64, activation="relu"), nn.Dense(64, activation="relu"), nn.Dense(10)],
        name="mlp",
        dtype=dtype,
    ).build(jax.random.key(0), digits().x_train[:1])


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_digits_mlp_reaches_95_percent(policy):
    model, history = train.fit(
        digits_mlp(policy), optax.adam(3e-3), "sparse_categorical_crossentropy",
        (digits().x_train, digits().y_train), epochs=12, batch_size=32,
        validation_data=(digits().x_val, digits().y_val), metrics=["accuracy"], progress=False,
    )
    scores = train.evaluate(model, (digits().x_test, digits().y_test), ["accuracy"])
    assert scores["accuracy"] >= 0.95, scores
    assert len(history["loss"]) == 12 and history["loss"][-1] < history["loss"][0] / 5
    assert history["val_accuracy"][-1] >= 0.93
    assert history.loss_scale is None and history.skipped_steps == 0  # bfloat16 needs no scaling
    assert model.layers[0].kernel.dtype == jnp.float32
    assert model.layers[0].dtype_policy.name == policy


def test_fit_accepts_an_iterable_of_batches_and_is_deterministic():
    batches = [(digits().x_train[i : i + 64], digits().y_train[i : i + 64]) for i in range(0, 640, 64)]
    a, ha = train.fit(digits_mlp(), optax.sgd(0.1), "sparse_categorical_crossentropy", batches,
                      epochs=2, progress=False)
    b, hb = train.fit(digits_mlp(), optax.sgd(0.1), "sparse_categorical_crossentropy", batches,
                      epochs=2, progress=False)
    assert ha.steps == 20
    np.testing.assert_array_equal(a.layers[0].kernel, b.layers[0].kernel)
    assert ha["loss"] == hb["loss"]


def test_predict_matches_the_model_and_evaluate_reports_the_loss():
    model = digits_mlp()
    out = train.predict(model, digits().x_test, batch_size=100)
    np.testing.assert_allclose(out, np.asarray(model(digits().x_test)), rtol=1e-5, atol=1e-6)
    scores = train.evaluate(model, (digits().x_test, digits().y_test), ["accuracy"],
                            loss="sparse_categorical_crossentropy")
    expected = float(train.losses.sparse_categorical_crossentropy(digits().y_test, jnp.asarray(out)))
    assert scores["loss"] == pytest.approx(expected, rel=1e-5)
    assert 0.0 <= scores["accuracy"] <= 0.3  # untrained


def test_losses_compute_in_float32():
    logits = jnp.array([[30.0, -30.0, 0.0]], jnp.float16)
    loss = train.losses.sparse_categorical_crossentropy(jnp.array([1]), logits)
    assert loss.dtype == jnp.float32 and float(loss) == pytest.approx(60.0, rel=1e-4)


@pytest.mark.parametrize(
    "kwargs,text",
    [
        ({"epochs": 0}, "epochs=0"),
        ({"batch_size": -1}, "batch_size=-1"),
        ({"loss": "hinge"}, "hinge"),
        ({"loss_scale": "sometimes"}, "sometimes"),
        ({"train_data": (np.ones((3, 64), np.float32), np.ones(2, np.int32))}, "3 != 2"),
        ({"metrics": ["f1"]}, "f1"),
    ],
)
def test_bad_arguments(kwargs, text):
    args = {"loss": "sparse_categorical_crossentropy", "train_data": (digits().x_train, digits().y_train),
            "epochs": 1, "progress": False, **kwargs}
    with pytest.raises(ValueError) as info:
        train.fit(digits_mlp(), optax.sgd(0.1), **args)
    assert text in str(info.value)


def test_fit_needs_a_built_model():
    with pytest.raises(ValueError, match="built"):
        train.fit(nn.Dense(2), optax.sgd(0.1), "mse", (np.ones((2, 3)), np.ones((2, 2))), progress=False)
