"""AWQ (Lin et al., 2023): scale each input channel before quantizing, by a power of its mean
activation magnitude, so that the channels that carry large inputs lose less to rounding.

For a Dense kernel ``W`` ``(K, N)`` and calibration inputs ``X`` ``(M, K)``: with
``s = mean|X|^alpha`` per input channel (normalized by ``sqrt(max(s) * min(s))``, floored at
1e-4), the kernel is quantized as ``Q(s * W)`` (rows scaled) and run as ``Q(s * W) / s``: the
division folds into the dequantized kernel (Keras's ``awq_scales``, divided in its
``_awq_call``), equivalently into the inputs (``(X / s) Q(s W)``). ``alpha`` is searched over a
grid of ``n_grid + 1`` points in ``[0, 1]`` for the least output error ``||X W - X Q(sW)/s||^2``
on the calibration inputs; ``alpha = 0`` is plain round-to-nearest, so the search never does
worse than it on those inputs. (Keras 3.15's AWQ scores the grid by an activation-weighted
weight error from per-channel maxima instead; this is the paper's output error.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.numerics import weight_only

__all__ = ["DEFAULT_GRID", "channel_scales", "awq_quantize"]

DEFAULT_GRID = 20
_MIN_SCALE = 1e-4


def channel_scales(mean_abs: jax.Array, alpha: jax.Array) -> jax.Array:
    """``mean_abs ** alpha``, floored and normalized to a geometric mid-range of 1.

    >>> channel_scales(jnp.array([1.0, 4.0]), 1.0).tolist()
    [0.5, 2.0]
    """
    s = jnp.maximum(jnp.power(jnp.maximum(mean_abs, 1e-8), alpha), _MIN_SCALE)
    return s / jnp.sqrt(jnp.max(s) * jnp.min(s))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _search(kernel: jax.Array, x: jax.Array, bits: int, group_size: int, n_grid: int):
    reference = jnp.matmul(x, kernel, precision=jax.lax.Precision.HIGHEST)
    mean_abs = jnp.mean(jnp.abs(x), axis=0)

    def error(alpha):
        s = channel_scales(mean_abs, alpha)
        q, scale, zero = weight_only.round_to_nearest((kernel * s[:, None]).T, bits, group_size)
        k = kernel.shape[0]
        groups = jnp.asarray(weight_only.group_index(k, group_size), jnp.int32)
        w_hat = (weight_only.dequantize_grid(q, scale[:, groups], zero[:, groups]) / s).T
        out = jnp.matmul(x, w_hat, precision=jax.lax.Precision.HIGHEST)
        return jnp.mean(jnp.square(out - reference))

    alphas = jnp.linspace(0.0, 1.0, n_grid + 1)
    errors = jax.lax.map(error, alphas)
    best = jnp.argmin(errors)
    return alphas[best], errors, channel_scales(mean_abs, alphas[best])


def awq_quantize(kernel: jax.Array, x: jax.Array, bits: int, group_size: int, *, n_grid: int = DEFAULT_GRID):
    """AWQ of a Dense kernel ``(K, N)`` on calibration inputs ``x`` ``(M, K)``.

    Returns:
      ``(q, scale, zero, g_idx, awq_scales, alpha)``: the grid values ``(N, K)`` of ``s * W``,
      their ``(N, G)`` scales and zero points, ``g_idx`` ``(K,)``, the channel scales ``s``
      ``(K,)`` and the chosen ``alpha``.
    """
    if isinstance(n_grid, bool) or not isinstance(n_grid, int) or n_grid < 1:
        raise ValueError(f"n_grid must be a positive int. Received: n_grid={n_grid!r}")
    kernel = jnp.asarray(kernel, jnp.float32)
    x = jnp.asarray(x, jnp.float32).reshape((-1, kernel.shape[0]))
    alpha, _, s = _search(kernel, x, bits, group_size, n_grid)
    q, scale, zero = weight_only.round_to_nearest((kernel * s[:, None]).T, bits, group_size)
    g_idx = weight_only.group_index(kernel.shape[0], group_size)
    return q, scale, zero, g_idx, s, float(np.asarray(alpha))


def quantize_weights(kernel, *args, **kwargs) -> dict:
    """The mode's quantizer (before calibration): see :func:`weight_only.uncalibrated_weights`."""
    return weight_only.uncalibrated_weights(kernel, *args, **kwargs)
