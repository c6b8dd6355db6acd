"""GPTQ (Frantar et al., 2022): quantize a layer's weights column by column, each column's rounding
error spread over the columns not yet quantized through the inverse of the inputs' Hessian.

For a Dense kernel ``W`` (``K`` inputs, ``N`` outputs) and calibration inputs ``X`` ``(M, K)``
the layer's squared output error ``||X W - X Q||^2`` has the Hessian ``H = 2 X^T X / M`` in
each output's weights. With ``U`` the upper Cholesky factor of ``H^-1`` (after damping), input
column ``j`` (a row of ``W``) is rounded to the grid and its error, divided by ``U[j, j]``, is
subtracted from the later columns times ``U[j, j+1:]`` (the optimal update of the rest). Group
scales and zero points are computed from the already-updated weights when the first column of a
group is reached; with one group per output channel, from the whole kernel first. Act-order
(off by default, as Keras) quantizes columns in order of decreasing ``H[j, j]``; groups then
follow that order and ``g_idx`` records each input's group.

Columns whose ``H[j, j]`` is 0 (an input that is always 0) are set to 0 and get ``H[j, j] = 1``;
the damping adds ``damping * mean(diag(H))`` to the diagonal (Keras's ``hessian_damping``, 0.01).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.numerics import weight_only

__all__ = ["DEFAULT_DAMPING", "hessian_update", "gptq_quantize"]

DEFAULT_DAMPING = 0.01


def hessian_update(hessian: jax.Array | None, count: int, x: jax.Array) -> tuple[jax.Array, int]:
    """Adds the rows of ``x`` ``(m, K)`` to the running ``H = 2 X^T X / count``.

    >>> h, n = hessian_update(None, 0, jnp.ones((2, 3)))
    >>> h, n = hessian_update(h, n, jnp.zeros((2, 3)))
    >>> float(h[0, 0]), n
    (1.0, 4)
    """
    x = jnp.asarray(x, jnp.float32).reshape((-1, x.shape[-1]))
    m = x.shape[0]
    total = count + m
    term = (2.0 / total) * jnp.matmul(x.T, x, precision=jax.lax.Precision.HIGHEST)
    if hessian is None:
        return term, total
    return hessian * (count / total) + term, total


def _prepared_inverse(hessian: jax.Array, damping: float) -> tuple[jax.Array, jax.Array]:
    """``(U, dead)``: the upper Cholesky factor of the damped ``H^-1`` and the dead columns."""
    diag = jnp.diagonal(hessian)
    dead = diag == 0
    h = hessian + jnp.diag(jnp.where(dead, 1.0, 0.0))
    h = h + jnp.eye(h.shape[0], dtype=h.dtype) * (damping * jnp.mean(jnp.diagonal(h)))
    lower = jnp.linalg.cholesky(h)
    eye = jnp.eye(h.shape[0], dtype=h.dtype)
    h_inv = jax.scipy.linalg.cho_solve((lower, True), eye)
    return jnp.linalg.cholesky(h_inv).T, dead


# One compilation, not one per primitive (the Cholesky factorizations' eager compiles were most
# of a small model's calibration time).
@functools.partial(jax.jit, static_argnums=3)
def _padded_problem(w_t: jax.Array, hessian: jax.Array, damping: float,
                    padded: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(w_t, U, finite)`` padded to ``padded`` columns, dead columns zeroed; ``finite``: whether
    the damped Hessian was positive definite."""
    k = w_t.shape[1]
    u, dead = _prepared_inverse(hessian, damping)
    w_t = jnp.where(dead[None, :], 0.0, w_t)
    # Padding columns are 0 with an identity Hessian block: they quantize exactly, feed back nothing.
    w_p = jnp.pad(w_t, [(0, 0), (0, padded - k)])
    u_p = jnp.pad(u, [(0, padded - k), (0, padded - k)])
    u_p = u_p + jnp.diag(jnp.where(jnp.arange(padded) >= k, 1.0, 0.0))
    return w_p, u_p, jnp.all(jnp.isfinite(u))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _quantize_columns(w_t: jax.Array, u: jax.Array, bits: int, group_size: int,
                      per_channel: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The GPTQ loop over the columns of ``w_t`` ``(N, K)``, ``K`` a multiple of ``group_size``."""
    n, k = w_t.shape
    groups = k // group_size
    columns = jnp.arange(k)
    if per_channel:
        scale0, zero0 = weight_only.group_params(w_t, bits)
    else:
        scale0 = zero0 = jnp.zeros((n,), jnp.float32)

    def body(j, carry):
        w, q, scales, zeros, scale, zero = carry
        if not per_channel:
            def fresh(_):
                return weight_only.group_params(jax.lax.dynamic_slice_in_dim(w, j, group_size, axis=1), bits)

            scale, zero = jax.lax.cond(j % group_size == 0, fresh, lambda _: (scale, zero), None)
        col = jax.lax.dynamic_index_in_dim(w, j, axis=1, keepdims=False)
        qj = weight_only.quantize_to_grid(col, scale, zero, bits)
        err = (col - weight_only.dequantize_grid(qj, scale, zero)) / u[j, j]
        row = jnp.where(columns > j, u[j], 0.0)
        w = w - err[:, None] * row[None, :]
        q = jax.lax.dynamic_update_index_in_dim(q, qj, j, axis=1)
        g = j // group_size
        scales = jax.lax.dynamic_update_index_in_dim(scales, scale, g, axis=1)
        zeros = jax.lax.dynamic_update_index_in_dim(zeros, zero, g, axis=1)
        return w, q, scales, zeros, scale, zero

    init = (w_t, jnp.zeros_like(w_t), jnp.zeros((n, groups), jnp.float32), jnp.zeros((n, groups), jnp.float32),
            scale0, zero0)
    _, q, scales, zeros, _, _ = jax.lax.fori_loop(0, k, body, init)
    return q, scales, zeros


def gptq_quantize(
    kernel: jax.Array,
    hessian: jax.Array,
    bits: int,
    group_size: int,
    *,
    damping: float = DEFAULT_DAMPING,
    act_order: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, np.ndarray]:
    """GPTQ of a Dense kernel ``(K, N)`` given the Hessian ``(K, K)`` of its inputs.

    Args:
      kernel: The float kernel, inputs along axis 0.
      hessian: ``2 X^T X / M`` of the layer's calibration inputs (:func:`hessian_update`).
      bits: Bits per weight (2, 3, 4 or 8).
      group_size: Inputs per group, or ``weight_only.PER_CHANNEL`` (-1).
      damping: The fraction of the mean diagonal added to the diagonal.
      act_order: Quantize columns in order of decreasing ``H[j, j]``.

    Returns:
      ``(q, scale, zero, g_idx)`` in Keras's layout (see :mod:`weight_only`): ``q`` ``(N, K)``
      grid values (float32), ``scale`` and ``zero`` ``(N, G)`` float32, ``g_idx`` ``(K,)``.

    Raises:
      ValueError: if the shapes do not fit or the damped Hessian is not positive definite.
    """
    k, n = kernel.shape
    if hessian.shape != (k, k):
        raise ValueError(f"The Hessian of a kernel with {k} inputs is ({k}, {k}). Received {hessian.shape}")
    hessian = jnp.asarray(hessian, jnp.float32)
    w_t = jnp.asarray(kernel, jnp.float32).T
    perm = np.arange(k)
    if act_order:
        perm = np.argsort(-np.asarray(jnp.diagonal(hessian)), kind="stable")
        w_t, hessian = w_t[:, perm], hessian[perm][:, perm]
    per_channel = group_size == weight_only.PER_CHANNEL
    size = k if per_channel else group_size
    padded = weight_only.group_count(k, group_size) * size
    w_p, u_p, finite = _padded_problem(w_t, hessian, damping, padded)
    if not bool(finite):
        raise ValueError("GPTQ: the damped Hessian of the calibration inputs is not positive definite; "
                         "raise the damping or calibrate on more (and more varied) inputs.")
    q, scale, zero = _quantize_columns(w_p, u_p, bits, size, per_channel)
    q = q[:, :k]
    g_idx = (np.arange(k) // size).astype(np.float32)
    if act_order:
        inverse = np.argsort(perm)
        q, g_idx = q[:, inverse], g_idx[inverse]
    return q, scale, zero, g_idx


def quantize_weights(kernel: Any, *args: Any, **kwargs: Any) -> dict:
    """The mode's quantizer (before calibration): see :func:`weight_only.uncalibrated_weights`."""
    return weight_only.uncalibrated_weights(kernel, *args, **kwargs)
