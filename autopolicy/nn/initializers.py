"""Weight initializers by Keras name, or any ``fn(key, shape, dtype)``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

__all__ = ["get", "NAMES"]

Initializer = Callable[[jax.Array, tuple, Any], jax.Array]

# name -> (scale, fan mode, distribution) of Keras's VarianceScaling family.
_VARIANCE_SCALING = {
    "glorot_uniform": (1.0, "fan_avg", "uniform"),
    "glorot_normal": (1.0, "fan_avg", "truncated_normal"),
    "he_uniform": (2.0, "fan_in", "uniform"),
    "he_normal": (2.0, "fan_in", "truncated_normal"),
    "lecun_uniform": (1.0, "fan_in", "uniform"),
    "lecun_normal": (1.0, "fan_in", "truncated_normal"),
}


def _zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


def _ones(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


def _random_normal(key, shape, dtype):
    return 0.05 * jax.random.normal(key, shape, dtype)


def _random_uniform(key, shape, dtype):
    return jax.random.uniform(key, shape, dtype, -0.05, 0.05)


_FIXED: dict[str, Initializer] = {
    "zeros": _zeros,
    "ones": _ones,
    "random_normal": _random_normal,
    "random_uniform": _random_uniform,
    "uniform": _random_uniform,
    "normal": _random_normal,
}
NAMES = tuple(_VARIANCE_SCALING) + tuple(_FIXED)


def get(
    identifier: Any, in_axis: int | Sequence[int] = -2, out_axis: int | Sequence[int] = -1
) -> Initializer:
    """Returns the initializer named ``identifier``, or ``identifier`` if it is callable.

    Args:
      identifier: A name from :data:`NAMES` or ``fn(key, shape, dtype)``.
      in_axis, out_axis: The kernel axes that count as fan-in and fan-out for the
        variance-scaling family (tuples for einsum kernels); other axes are the receptive field.

    >>> get("zeros")(None, (2,), jnp.float32)
    Array([0., 0.], dtype=float32)
    """
    if callable(identifier):
        return identifier
    if isinstance(identifier, str) and identifier in _VARIANCE_SCALING:
        scale, mode, distribution = _VARIANCE_SCALING[identifier]
        return jax.nn.initializers.variance_scaling(
            scale, mode, distribution, in_axis=in_axis, out_axis=out_axis
        )
    if isinstance(identifier, str) and identifier in _FIXED:
        return _FIXED[identifier]
    raise ValueError(
        f"Unknown initializer. Expected one of {NAMES} or a function fn(key, shape, dtype). "
        f"Received: {identifier!r}"
    )


def check(identifier: Any, argument: str) -> Any:
    """Validates an initializer argument at construction (returns it unchanged)."""
    try:
        get(identifier)
    except ValueError as e:
        raise ValueError(f"Invalid {argument}: {e}") from None
    return identifier
