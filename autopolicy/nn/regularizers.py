"""Weight penalties, computed in float32 from the stored (variable-dtype) weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["L1", "L2", "L1L2"]


def _check(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0. Received: {name}={value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class L1L2:
    """``l1 * sum(|w|) + l2 * sum(w**2)``.

    >>> float(L1L2(l1=0.5, l2=1.0)(jnp.array([1.0, -2.0])))
    6.5
    """

    l1: float = 0.0
    l2: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "l1", _check("l1", self.l1))
        object.__setattr__(self, "l2", _check("l2", self.l2))

    def __call__(self, weight: jax.Array) -> jax.Array:
        w = jnp.asarray(weight).astype(jnp.float32)
        return self.l1 * jnp.sum(jnp.abs(w)) + self.l2 * jnp.sum(jnp.square(w))


def L1(l1: float = 0.01) -> L1L2:  # noqa: N802  (Keras's spelling)
    """An L1 penalty."""
    return L1L2(l1=l1)


def L2(l2: float = 0.01) -> L1L2:  # noqa: N802
    """An L2 penalty."""
    return L1L2(l2=l2)
