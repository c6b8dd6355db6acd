"""digits_mlp: a 64-512-512-10 MLP on scikit-learn's bundled 8x8 digits (the default experiment).

Scored by validation accuracy; timed at batch 512. Trained once (about 10 s), then cached.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from autopolicy import datasets, nn, train
from autopolicy.experiment import Experiment, cached_model

DESCRIPTION = "MLP 64-512-512-10 on scikit-learn digits, batch 512; metric: validation accuracy"
BATCH = 512


def _train(data: datasets.Split) -> nn.Module:
    model = nn.Sequential(
        [nn.Dense(512, activation="relu"), nn.Dense(512, activation="relu"), nn.Dense(10)], name="digits_mlp"
    ).build(jax.random.key(0), data.x_train[:1])
    model, _ = train.fit(model, optax.adam(1e-3), "sparse_categorical_crossentropy",
                         (data.x_train, data.y_train), epochs=10, batch_size=32, seed=0)
    return model


def build(cache_dir) -> Experiment:
    data = datasets.digits(seed=0)
    model = cached_model(cache_dir, "digits_mlp-v1", lambda: _train(data))
    return Experiment(
        name="digits_mlp",
        model=model,
        eval_fn=lambda m: train.evaluate(m, (data.x_val, data.y_val))["accuracy"],
        test_fn=lambda m: train.evaluate(m, (data.x_test, data.y_test))["accuracy"],
        sample_input=jnp.asarray(np.resize(data.x_train, (BATCH, 64))),
        calibration_inputs=[jnp.asarray(data.x_train[:256])],
        max_drop=0.01,
        metric_name="validation accuracy",
        description=DESCRIPTION,
    )
