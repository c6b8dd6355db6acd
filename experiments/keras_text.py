"""keras_text: a byte-level transformer language model built from Keras 3 layers (JAX backend).

The Keras twin of ``text_transformer``: token embedding plus a learned position embedding, two
pre-norm blocks (LayerNormalization, causal MultiHeadAttention with 4 heads, a GELU Dense MLP)
of width 128, a final norm and a byte head, over 64-byte windows of the Python standard
library's own sources. Trained briefly with ``model.fit``; scored by next-byte accuracy on
held-out files. The trained model is cached as a ``.keras`` file.
"""

from __future__ import annotations

import os
import pathlib

import autopolicy.keras  # noqa: F401  (defaults KERAS_BACKEND to jax before Keras is imported)
import keras
import numpy as np

from autopolicy import datasets
from autopolicy.experiment import Experiment

DESCRIPTION = ("Keras byte-level LM, 2 pre-norm blocks (d=128, 4 heads, Keras MultiHeadAttention), 64-byte "
               "context; metric: held-out next-byte accuracy")
SEQ, DIM, HEADS, MLP, BLOCKS = 64, 128, 4, 512, 2
BATCH = 32
STEPS = 500
CACHE_NAME = "keras_text-v1.keras"


@keras.saving.register_keras_serializable("autopolicy_experiments")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position (the window length is fixed)."""

    def __init__(self, length: int, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def build(self, input_shape):
        self.positions = self.add_weight(shape=(self.length, input_shape[-1]), name="positions",
                                         initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        return x + self.positions

    def get_config(self):
        return {**super().get_config(), "length": self.length}


def make_model() -> keras.Model:
    """The untrained Functional model (layer paths like ``block_0_attention/query``)."""
    layers = keras.layers
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    x = PositionEmbedding(SEQ, name="positions")(layers.Embedding(256, DIM, name="tokens")(ids))
    for i in range(BLOCKS):
        h = layers.LayerNormalization(epsilon=1e-5, name=f"block_{i}_norm_1")(x)
        h = layers.MultiHeadAttention(HEADS, DIM // HEADS, name=f"block_{i}_attention")(h, h, use_causal_mask=True)
        x = layers.Add(name=f"block_{i}_add_1")([x, h])
        h = layers.LayerNormalization(epsilon=1e-5, name=f"block_{i}_norm_2")(x)
        h = layers.Dense(MLP, activation="gelu", name=f"block_{i}_mlp_in")(h)
        h = layers.Dense(DIM, name=f"block_{i}_mlp_out")(h)
        x = layers.Add(name=f"block_{i}_add_2")([x, h])
    x = layers.LayerNormalization(epsilon=1e-5, name="norm")(x)
    return keras.Model(ids, layers.Dense(256, name="head")(x), name="keras_text")


def windows(stream: np.ndarray, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` random (input, next-byte target) windows of length SEQ from ``stream``."""
    starts = np.random.default_rng(seed).integers(0, len(stream) - SEQ - 1, count)
    x = np.stack([stream[s : s + SEQ] for s in starts]).astype(np.int32)
    y = np.stack([stream[s + 1 : s + SEQ + 1] for s in starts]).astype(np.int32)
    return x, y


def train(stream: np.ndarray, steps: int = STEPS) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = make_model()
    schedule = keras.optimizers.schedules.CosineDecay(0.0, steps, warmup_target=3e-3, warmup_steps=50)
    model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01, clipnorm=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = windows(stream, steps * BATCH, seed=1)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def cached_keras_model(cache_dir, train_fn) -> keras.Model:
    """The model saved as ``cache_dir/CACHE_NAME``, or ``train_fn()``'s (then saved there)."""
    path = pathlib.Path(cache_dir) / CACHE_NAME
    if path.is_file():
        return keras.saving.load_model(path, compile=False)
    model = train_fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.stem}.{os.getpid()}.keras")  # written whole, then renamed
    model.save(partial)
    os.replace(partial, path)
    return keras.saving.load_model(path, compile=False)


def accuracy(model: keras.Model, data: tuple[np.ndarray, np.ndarray]) -> float:
    """Next-byte accuracy of ``model`` on ``(x, y)`` windows."""
    logits = model.predict(data[0], batch_size=64, verbose=0)
    return float(np.mean(np.argmax(np.asarray(logits, np.float32), axis=-1) == data[1]))


def build(cache_dir) -> Experiment:
    train_stream, held_out = datasets.python_source_bytes(num_bytes=2_000_000, seed=0)
    model = cached_keras_model(cache_dir, lambda: train(train_stream))
    val = windows(held_out[: len(held_out) // 2], 256, seed=2)
    test = windows(held_out[len(held_out) // 2 :], 256, seed=3)
    return Experiment(
        name="keras_text",
        model=model,
        eval_fn=lambda m: accuracy(m, val),
        test_fn=lambda m: accuracy(m, test),
        sample_input=val[0][:BATCH],
        calibration_inputs=[val[0][:64]],
        max_drop=0.01,
        metric_name="held-out next-byte accuracy",
        description=DESCRIPTION,
    )
