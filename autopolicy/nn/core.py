"""Parameter-free layers: Activation, Softmax, Dropout, Flatten, GlobalAveragePooling1D."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autopolicy.nn import _context, activations
from autopolicy.nn.activations import accumulation_dtype
from autopolicy.nn._module import Module

__all__ = ["Activation", "Softmax", "Dropout", "Flatten", "GlobalAveragePooling1D"]


class Activation(Module):
    """Applies an activation (a name such as ``"relu"`` or a callable)."""

    def __init__(self, activation: Any, *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        activations.get(activation)
        self.activation = activation

    def call(self, x: jax.Array) -> jax.Array:
        return activations.get(self.activation)(x)


class Softmax(Module):
    """Softmax over ``axis``, computed in float32 and returned in the compute dtype.

    ``mask`` (True where allowed) broadcasts against the input; masked entries get 0.

    >>> import autopolicy.nn as nn
    >>> sm = nn.Softmax(dtype="float16").build(jax.random.key(0), jnp.ones(3))
    >>> sm(jnp.array([1e3, 1e3, -1e3]))
    Array([0.5, 0.5, 0. ], dtype=float16)
    """

    tunable = True

    def __init__(self, axis: int = -1, *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        self.axis = int(axis)

    def call(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        xf = x.astype(accumulation_dtype(x.dtype))
        if mask is not None:
            xf = jnp.where(mask, xf, jnp.finfo(xf.dtype).min)
        return jax.nn.softmax(xf, axis=self.axis).astype(x.dtype)


class Dropout(Module):
    """Zeroes a fraction ``rate`` of the inputs while training (and rescales the rest).

    Needs randomness while training: call the model inside ``with nn.rng_scope(key):`` (the
    training loop does this for you).
    """

    def __init__(self, rate: float, *, name: str | None = None, dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
            raise ValueError(f"rate must be a number in [0, 1). Received: rate={rate!r}")
        self.rate = float(rate)

    def call(self, x: jax.Array, training: bool = False) -> jax.Array:
        return dropout(self, x, self.rate, training)


def dropout(layer: Module, x: jax.Array, rate: float, training: bool) -> jax.Array:
    """Dropout for ``layer`` (which names the randomness it draws)."""
    if not training or rate == 0.0:
        return x
    key = _context.next_rng_key(layer.path)
    if key is None:
        raise RuntimeError(
            f"{layer.path!r} applies dropout while training and needs randomness: call the model "
            "inside `with autopolicy.nn.rng_scope(key):`."
        )
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


class Flatten(Module):
    """Flattens every axis but the first."""

    def call(self, x: jax.Array) -> jax.Array:
        return x.reshape((x.shape[0], -1))


class GlobalAveragePooling1D(Module):
    """Averages over the sequence axis (axis 1), in float32, with an optional mask ``(B, T)``."""

    def call(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        xf = x.astype(accumulation_dtype(x.dtype))
        if mask is None:
            return jnp.mean(xf, axis=1).astype(x.dtype)
        m = mask.astype(xf.dtype)[..., None]
        return (jnp.sum(xf * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)).astype(x.dtype)
