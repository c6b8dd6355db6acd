"""my_experiment: a small MLP on scikit-learn's digits, the form of any experiment file.

``autopolicy tune my_experiment.py`` imports this file and calls ``build(cache_dir)``.
"""

import jax
import optax

from autopolicy import datasets, nn, train
from autopolicy.experiment import Experiment, cached_model

DESCRIPTION = "MLP 64-64-10 on scikit-learn digits, batch 256; metric: validation accuracy"


def build(cache_dir):
    data = datasets.digits(seed=0)

    def fit():  # runs once; the trained weights are cached in cache_dir
        model = nn.Sequential([nn.Dense(64, activation="relu"), nn.Dense(10)], name="mlp")
        model = model.build(jax.random.key(0), data.x_train[:1])
        model, _ = train.fit(model, optax.adam(3e-3), "sparse_categorical_crossentropy",
                             (data.x_train, data.y_train), epochs=3, progress=False)
        return model

    return Experiment(
        name="my_experiment",
        model=cached_model(cache_dir, "my_experiment-v1", fit),
        eval_fn=lambda m: train.evaluate(m, (data.x_val, data.y_val))["accuracy"],
        test_fn=lambda m: train.evaluate(m, (data.x_test, data.y_test))["accuracy"],
        sample_input=data.x_train[:256],
        max_drop=0.01,
        metric_name="validation accuracy",
        description=DESCRIPTION,
    )
