"""LayerNormalization, RMSNormalization and UnitNormalization (L2), computed in float32 whatever
the compute dtype."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autopolicy.nn import initializers
from autopolicy.nn.activations import accumulation_dtype
from autopolicy.nn._module import Module

__all__ = ["LayerNormalization", "RMSNormalization", "UnitNormalization"]


class LayerNormalization(Module):
    """Normalizes over the last axis: ``(x - mean) / sqrt(var + epsilon) * gamma + beta``.

    The statistics and the affine step run in float32 or wider (a float16 variance of values
    ~1e3 overflows); the result comes back in the compute dtype. ``gamma`` and ``beta`` stay in the
    variable dtype inside the computation.

    >>> import autopolicy.nn as nn
    >>> ln = nn.LayerNormalization(dtype="mixed_float16").build(jax.random.key(0), jnp.ones((2, 4)))
    >>> y = ln(jnp.array([[1e3, 2e3, 3e3, 4e3]]))
    >>> y.dtype, bool(jnp.isfinite(y).all())
    (dtype('float16'), True)
    """

    tunable = True

    def __init__(self, epsilon: float = 1e-3, center: bool = True, scale: bool = True,
                 beta_initializer: Any = "zeros", gamma_initializer: Any = "ones",
                 *, name: str | None = None, dtype: Any = None, autocast: bool = True):
        super().__init__(name=name, dtype=dtype, autocast=autocast)
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
            raise ValueError(f"epsilon must be a number > 0. Received: epsilon={epsilon!r}")
        self.epsilon = float(epsilon)
        self.center = bool(center)
        self.scale = bool(scale)
        self.beta_initializer = initializers.check(beta_initializer, "beta_initializer")
        self.gamma_initializer = initializers.check(gamma_initializer, "gamma_initializer")
        self.gamma = None
        self.beta = None

    def build_variables(self, x: jax.Array) -> None:
        dim = x.shape[-1]
        if self.scale:
            self.add_weight("gamma", (dim,), self.gamma_initializer, autocast=False)
        if self.center:
            self.add_weight("beta", (dim,), self.beta_initializer, autocast=False)

    def call(self, x: jax.Array) -> jax.Array:
        acc = accumulation_dtype(x.dtype)
        xf = x.astype(acc)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.epsilon)
        if self.gamma is not None:
            y = y * self.gamma.astype(acc)
        if self.beta is not None:
            y = y + self.beta.astype(acc)
        return y.astype(x.dtype)


class RMSNormalization(Module):
    """Root-mean-square normalization over the last axis, as Keras's ``RMSNormalization`` and
    llama-family models: ``x / sqrt(mean(x**2) + epsilon) * scale``.

    The statistic and the scaling run in float32 or wider; the result comes back in the
    compute dtype. ``scale`` stays in the variable dtype inside the computation.

    >>> import autopolicy.nn as nn
    >>> norm = nn.RMSNormalization(epsilon=1e-6).build(jax.random.key(0), jnp.ones((1, 2)))
    >>> [round(float(v), 4) for v in norm(jnp.array([[3.0, 4.0]]))[0]]  # the RMS of (3, 4) is sqrt(12.5)
    [0.8485, 1.1314]
    """

    tunable = True

    def __init__(self, epsilon: float = 1e-6, scale_initializer: Any = "ones",
                 *, name: str | None = None, dtype: Any = None, autocast: bool = True):
        super().__init__(name=name, dtype=dtype, autocast=autocast)
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
            raise ValueError(f"epsilon must be a number > 0. Received: epsilon={epsilon!r}")
        self.epsilon = float(epsilon)
        self.scale_initializer = initializers.check(scale_initializer, "scale_initializer")
        self.scale = None

    def build_variables(self, x: jax.Array) -> None:
        self.add_weight("scale", (x.shape[-1],), self.scale_initializer, autocast=False)

    def call(self, x: jax.Array) -> jax.Array:
        acc = accumulation_dtype(x.dtype)
        xf = x.astype(acc)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.epsilon)
        return (y * self.scale.astype(acc)).astype(x.dtype)


class UnitNormalization(Module):
    """L2 normalization over ``axis``: ``x / max(||x||, epsilon)``, as Keras's
    ``UnitNormalization`` and PyTorch's ``F.normalize`` (sentence embeddings).

    The norm runs in float32 or wider; the result comes back in the compute dtype. An all-zero
    vector stays zero.

    >>> import autopolicy.nn as nn
    >>> unit = nn.UnitNormalization().build(jax.random.key(0), jnp.ones((1, 2)))
    >>> unit(jnp.array([[3.0, 4.0], [0.0, 0.0]]))
    Array([[0.6, 0.8],
           [0. , 0. ]], dtype=float32)
    """

    def __init__(self, axis: int = -1, epsilon: float = 1e-12, *, name: str | None = None,
                 dtype: Any = None):
        super().__init__(name=name, dtype=dtype)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"axis must be an int. Received: axis={axis!r}")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
            raise ValueError(f"epsilon must be a number > 0. Received: epsilon={epsilon!r}")
        self.axis = axis
        self.epsilon = float(epsilon)

    def call(self, x: jax.Array) -> jax.Array:
        xf = x.astype(accumulation_dtype(x.dtype))
        norm = jnp.sqrt(jnp.sum(jnp.square(xf), axis=self.axis, keepdims=True))
        return (xf / jnp.maximum(norm, self.epsilon)).astype(x.dtype)
