"""digits_cnn: a small convolutional network on scikit-learn's bundled 8x8 digits.

Two 3x3 convolutions, max pooling, two dense layers; scored by validation accuracy and timed at
batch 256. Trained once, then cached.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from autopolicy import datasets, nn, train
from autopolicy.experiment import Experiment, cached_model

DESCRIPTION = "CNN conv32-conv64-pool-dense256-dense10 on digits images, batch 256; metric: validation accuracy"
BATCH = 256


def _train(data: datasets.Split) -> nn.Module:
    model = nn.Sequential(
        [
            nn.Conv2D(32, 3, padding="same", activation="relu"),
            nn.Conv2D(64, 3, padding="same", activation="relu"),
            nn.MaxPooling2D(2),
            nn.Flatten(),
            nn.Dense(256, activation="relu"),
            nn.Dense(10),
        ],
        name="digits_cnn",
    ).build(jax.random.key(0), data.x_train[:1])
    model, _ = train.fit(model, optax.adam(1e-3), "sparse_categorical_crossentropy",
                         (data.x_train, data.y_train), epochs=8, batch_size=32, seed=0)
    return model


def build(cache_dir) -> Experiment:
    data = datasets.digits(seed=0, image=True)
    model = cached_model(cache_dir, "digits_cnn-v1", lambda: _train(data))
    return Experiment(
        name="digits_cnn",
        model=model,
        eval_fn=lambda m: train.evaluate(m, (data.x_val, data.y_val))["accuracy"],
        test_fn=lambda m: train.evaluate(m, (data.x_test, data.y_test))["accuracy"],
        sample_input=jnp.asarray(np.resize(data.x_train, (BATCH, 8, 8, 1))),
        calibration_inputs=[jnp.asarray(data.x_train[:256])],
        max_drop=0.01,
        metric_name="validation accuracy",
        description=DESCRIPTION,
    )
