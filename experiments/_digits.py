"""Shared by the digits experiments: data, training and scoring of an MLP on scikit-learn's
bundled 8x8 digits (experiments import this helper; it is not an experiment itself)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from autopolicy import datasets, nn, train
from autopolicy.experiment import Experiment, cached_model


def mlp_experiment(name: str, widths: tuple[int, ...], batch: int, cache_dir, description: str,
                   epochs: int = 10) -> Experiment:
    """An MLP 64-widths-10 trained with Adam (cached), scored by validation accuracy and timed
    at ``batch`` rows."""
    data = datasets.digits(seed=0)

    def fit() -> nn.Module:
        layers = [nn.Dense(w, activation="relu") for w in widths] + [nn.Dense(10)]
        model = nn.Sequential(layers, name=name).build(jax.random.key(0), data.x_train[:1])
        model, _ = train.fit(model, optax.adam(1e-3), "sparse_categorical_crossentropy",
                             (data.x_train, data.y_train), epochs=epochs, batch_size=32, seed=0)
        return model

    model = cached_model(cache_dir, f"{name}-v1", fit)
    return Experiment(
        name=name,
        model=model,
        eval_fn=lambda m: train.evaluate(m, (data.x_val, data.y_val))["accuracy"],
        test_fn=lambda m: train.evaluate(m, (data.x_test, data.y_test))["accuracy"],
        sample_input=jnp.asarray(np.resize(data.x_train, (batch, 64))),
        calibration_inputs=[jnp.asarray(data.x_train[:256])],
        max_drop=0.01,
        metric_name="validation accuracy",
        description=description,
    )
