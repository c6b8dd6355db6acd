"""Losses, computed in float32 whatever the dtype of the predictions, returned as float32."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
    "binary_crossentropy",
    "mean_squared_error",
    "get",
    "NAMES",
]

Loss = Callable[[jax.Array, jax.Array], jax.Array]


def sparse_categorical_crossentropy(labels: jax.Array, logits: jax.Array) -> jax.Array:
    """Mean cross-entropy of integer ``labels`` against unnormalized ``logits``.

    >>> float(sparse_categorical_crossentropy(jnp.array([0]), jnp.array([[0.0, 0.0]]).astype(jnp.float16)))
    0.6931...
    """
    logits = logits.astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels.astype(jnp.int32)))


def categorical_crossentropy(targets: jax.Array, logits: jax.Array) -> jax.Array:
    """Mean cross-entropy of one-hot/probability ``targets`` against ``logits``."""
    return jnp.mean(optax.softmax_cross_entropy(logits.astype(jnp.float32), targets.astype(jnp.float32)))


def binary_crossentropy(targets: jax.Array, logits: jax.Array) -> jax.Array:
    """Mean sigmoid cross-entropy against ``logits``."""
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), targets.astype(jnp.float32)))


def mean_squared_error(targets: jax.Array, predictions: jax.Array) -> jax.Array:
    """Mean squared error in float32."""
    return jnp.mean(jnp.square(predictions.astype(jnp.float32) - targets.astype(jnp.float32)))


NAMES: dict[str, Loss] = {
    "sparse_categorical_crossentropy": sparse_categorical_crossentropy,
    "categorical_crossentropy": categorical_crossentropy,
    "binary_crossentropy": binary_crossentropy,
    "mean_squared_error": mean_squared_error,
    "mse": mean_squared_error,
}


def get(identifier: Any) -> Loss:
    """A loss by name, or ``fn(targets, predictions) -> scalar`` as it is."""
    if callable(identifier):
        return identifier
    if isinstance(identifier, str) and identifier in NAMES:
        return NAMES[identifier]
    raise ValueError(f"Unknown loss. Expected one of {tuple(NAMES)} or a callable. Received: loss={identifier!r}")
