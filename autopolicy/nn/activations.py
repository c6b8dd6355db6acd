"""Activations by Keras name, or any callable. Softmax and the like compute in float32.

``"gelu"`` is the exact (erf) GELU, as ``keras.activations.gelu(x, approximate=False)``, Hugging
Face BERT's ``"gelu"`` and PyTorch's default; ``"gelu_tanh"`` (also ``"gelu_approximate"``) is
the tanh approximation (``approximate=True``, Hugging Face's ``"gelu_new"``).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

__all__ = ["get", "NAMES", "softmax", "accumulation_dtype"]


def accumulation_dtype(dtype: Any) -> Any:
    """float32 for 16-bit (and smaller) floats, the dtype itself otherwise (float64 stays)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype.itemsize < 4 else dtype


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax computed in at least float32 (16-bit exponentials overflow), in ``x``'s dtype."""
    return jax.nn.softmax(x.astype(accumulation_dtype(x.dtype)), axis=axis).astype(x.dtype)


def _linear(x):
    return x


def _gelu(x):
    return jax.nn.gelu(x, approximate=False)


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def _leaky_relu(x):
    return jax.nn.leaky_relu(x, 0.2)


NAMES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "linear": _linear,
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "gelu_approximate": _gelu_tanh,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "elu": jax.nn.elu,
    "leaky_relu": _leaky_relu,
    "softplus": jax.nn.softplus,
    "softmax": softmax,
}


def get(identifier: Any) -> Callable[[jax.Array], jax.Array]:
    """Returns the activation named ``identifier`` (None is linear), or the callable itself.

    >>> get("relu")(jnp.array([-1.0, 2.0]))
    Array([0., 2.], dtype=float32)
    >>> [round(float(get(name)(jnp.array(-1.0))), 5) for name in ("gelu", "gelu_tanh")]
    [-0.15866, -0.15881]
    """
    if identifier is None:
        return _linear
    if callable(identifier):
        return identifier
    if isinstance(identifier, str) and identifier in NAMES:
        return NAMES[identifier]
    raise ValueError(
        f"Unknown activation. Expected None, one of {tuple(NAMES)} or a callable. "
        f"Received: activation={identifier!r}"
    )
