"""int8 quantization: symmetric abs-max scales, int8 x int8 products with int32 accumulators.

Weights are quantized once, per output channel; inputs are quantized at every call, per row (per
token) over the contracted axes. The product runs on int8 operands with an int32 accumulator and
is rescaled into the compute dtype. Inputs get a straight-through gradient: the gradient of the
same product with the dequantized kernel.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.numerics import _u8s8_dot

__all__ = [
    "INT8_MAX",
    "quantize_symmetric",
    "dequantize",
    "int8_einsum",
    "int8_conv",
    "int8_dense",
    "int8_gather",
    "column_sums",
    "quantize_weights",
    "einsum_kernel",
    "conv2d_kernel",
    "gather_kernel",
]

INT8_MAX = 127.0


def _reduce_axes(ndim: int, axes: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(a % ndim for a in axes))


def quantize_symmetric(
    x: jax.Array, axes: Sequence[int], scale_dtype: Any = jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """Quantizes ``x`` to int8 with one abs-max scale per slice along ``axes``.

    Args:
      x: A floating-point array.
      axes: The axes each scale covers (the contracted axes); the scale keeps them as size 1.
      scale_dtype: The dtype of the returned scale.

    Returns:
      ``(q, scale)`` with ``q`` int8 in [-127, 127] and ``x ~= q * scale``.

    >>> q, s = quantize_symmetric(jnp.array([[0.5, -1.0], [2.0, 0.25]]), axes=(1,))
    >>> q
    Array([[  64, -127],
           [ 127,   16]], dtype=int8)
    """
    axes = _reduce_axes(x.ndim, axes)
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
    # An all-zero slice gets scale 1 (its values quantize to 0 either way).
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(xf * (1.0 / scale)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale.astype(scale_dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``q * scale`` in ``dtype`` (``scale`` broadcasts against ``q``)."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def _einsum_spec(equation: str) -> tuple[str, str, str]:
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    return lhs, rhs, out


def contracted_axes(equation: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The axes of each operand that the einsum sums over (present in both, not in the output).

    >>> contracted_axes("abc,cde->abde")
    ((2,), (0,))
    """
    lhs, rhs, out = _einsum_spec(equation)
    if "." in lhs + rhs + out:
        raise ValueError(f"int8_einsum needs an equation without '...'. Received: {equation!r}")
    summed = [c for c in lhs if c in rhs and c not in out]
    return tuple(lhs.index(c) for c in summed), tuple(rhs.index(c) for c in summed)


def column_sums(kernel_q: jax.Array, contract_axes: Sequence[int]) -> jax.Array:
    """``128 * sum(kernel_q)`` over the contracted axes, in int32: what shifting the quantized
    inputs by +128 adds to each output, stored once so no call recomputes it.

    >>> column_sums(jnp.array([[1, -2], [3, 4]], jnp.int8), (0,))
    Array([512, 256], dtype=int32)
    """
    return 128 * jnp.sum(kernel_q, axis=tuple(contract_axes), dtype=jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def int8_einsum(
    equation: str,
    x: jax.Array,
    kernel_q: jax.Array,
    kernel_scale: jax.Array,
    compute_dtype: Any,
    kernel_colsum: jax.Array | None = None,
) -> jax.Array:
    """``einsum(equation, x, kernel)`` with ``x`` quantized per row and an int8 kernel.

    Args:
      equation: A two-operand einsum without ellipsis, e.g. ``"btd,dhk->bthk"``.
      x: The input, in the compute dtype.
      kernel_q: The int8 kernel (from :func:`quantize_symmetric` over the contracted axes).
      kernel_scale: Its scale, with the contracted axes kept as size 1.
      compute_dtype: The dtype of the result.
      kernel_colsum: Optional :func:`column_sums` of the kernel (saves recomputing them on the
        CPU path at every call).
    """
    return _int8_einsum_fwd(equation, x, kernel_q, kernel_scale, compute_dtype, kernel_colsum)[0]


def _int8_einsum_fwd(equation, x, kernel_q, kernel_scale, compute_dtype, kernel_colsum=None):
    if _u8s8_dot.AVAILABLE and jax.default_backend() == "cpu" and _is_matmul(equation):
        y = _u8_matmul_path(equation, x, kernel_q, kernel_scale, kernel_colsum)
    else:
        x_axes, _ = contracted_axes(equation)
        x_q, x_scale = quantize_symmetric(x, x_axes)
        acc = jnp.einsum(equation, x_q, kernel_q, preferred_element_type=jnp.int32)
        # The contracted axes are size 1 in both scales, so this einsum is their outer product
        # laid out like the output: one multiply per output element rescales the accumulator.
        scale = jnp.einsum(equation, x_scale, kernel_scale.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)  # no bf16 passes on accelerators
        y = acc.astype(jnp.float32) * scale
    return y.astype(compute_dtype), (x, kernel_q, kernel_scale, kernel_colsum)


def _is_matmul(equation: str) -> bool:
    """Whether the einsum is ``x[free_x, c] @ kernel[c, free_k]`` once reshaped to 2-D."""
    lhs, rhs, out = _einsum_spec(equation)
    summed = "".join(c for c in rhs if c in lhs and c not in out)
    if not summed or not lhs.endswith(summed) or not rhs.startswith(summed):
        return False
    free_x, free_k = lhs[: len(lhs) - len(summed)], rhs[len(summed) :]
    return out == free_x + free_k and not set(free_x) & set(free_k)


def _u8_matmul_path(equation, x, kernel_q, kernel_scale, kernel_colsum=None):
    """The int8 product on the CPU's u8 x s8 (VNNI) path; equals the s8 x s8 product."""
    lhs, _, out = _einsum_spec(equation)
    n_sum = sum(1 for c in lhs if c not in out)
    free_shape = x.shape[: x.ndim - n_sum]
    k = int(np.prod(x.shape[x.ndim - n_sum :]))
    out_shape = kernel_q.shape[n_sum:]
    n = int(np.prod(out_shape))
    x2 = x.reshape((-1, k)).astype(jnp.float32)
    amax = jnp.max(jnp.abs(x2), axis=1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    shifted = jnp.clip(jnp.round(x2 * (1.0 / x_scale)), -INT8_MAX, INT8_MAX) + 128.0
    x_u8 = shifted.astype(jnp.uint8)
    rows = x_u8.shape[0]
    if rows == 1:  # YNNPACK's kernel needs two rows; a copy costs less than the slow path.
        x_u8 = jnp.concatenate([x_u8, x_u8])
    k2 = kernel_q.reshape((k, n))
    colsum = column_sums(k2, (0,)) if kernel_colsum is None else kernel_colsum.reshape((n,))
    acc = _u8s8_dot.u8s8_matmul(x_u8, k2)[:rows] - colsum
    # Scales first, then the accumulator: the same rounding as the generic path, bit for bit.
    y = acc.astype(jnp.float32) * (x_scale * kernel_scale.astype(jnp.float32).reshape((1, n)))
    return y.reshape(free_shape + out_shape)


def _int8_einsum_bwd(equation, compute_dtype, residuals, g):
    x, kernel_q, kernel_scale, kernel_colsum = residuals
    kernel = dequantize(kernel_q, kernel_scale, x.dtype)
    _, vjp = jax.vjp(lambda x_: jnp.einsum(equation, x_, kernel), x)
    (dx,) = vjp(g.astype(x.dtype))
    # The int8 kernel and its scale are not trained: no gradient flows to them.
    colsum = None if kernel_colsum is None else np.zeros(kernel_colsum.shape, jax.dtypes.float0)
    return dx, np.zeros(kernel_q.shape, jax.dtypes.float0), jnp.zeros_like(kernel_scale), colsum


int8_einsum.defvjp(_int8_einsum_fwd, _int8_einsum_bwd)


def int8_dense(
    x: jax.Array,
    kernel_q: jax.Array,
    kernel_scale: jax.Array,
    compute_dtype: Any,
    kernel_colsum: jax.Array | None = None,
) -> jax.Array:
    """``x @ kernel`` over the last axis of ``x`` with an int8 ``(in, out)`` kernel.

    ``kernel_scale`` has shape ``(1, out)``.
    """
    lead = x.shape[:-1]
    x2 = x.reshape((-1, x.shape[-1]))
    y = int8_einsum("mk,kn->mn", x2, kernel_q, kernel_scale, compute_dtype, kernel_colsum)
    return y.reshape(lead + (kernel_q.shape[-1],))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def int8_conv(
    x: jax.Array,
    kernel_q: jax.Array,
    kernel_scale: jax.Array,
    strides: tuple[int, int],
    padding: str,
    compute_dtype: Any,
) -> jax.Array:
    """A 2-D NHWC convolution with an int8 HWIO kernel (scale ``(1, 1, 1, O)``).

    Each input example is quantized with one scale (a convolution contracts over a window, so a
    per-pixel scale would not factor out of the sum).
    """
    return _int8_conv_fwd(x, kernel_q, kernel_scale, strides, padding, compute_dtype)[0]


def _conv(x, k, strides, padding, **kwargs):
    return jax.lax.conv_general_dilated(
        x, k, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kwargs
    )


def _int8_conv_fwd(x, kernel_q, kernel_scale, strides, padding, compute_dtype):
    x_q, x_scale = quantize_symmetric(x, axes=(1, 2, 3))
    acc = _conv(x_q, kernel_q, strides, padding, preferred_element_type=jnp.int32)
    scale = x_scale * kernel_scale.astype(jnp.float32).reshape((1, 1, 1, -1))
    y = (acc.astype(jnp.float32) * scale).astype(compute_dtype)
    return y, (x, kernel_q, kernel_scale)


def _int8_conv_bwd(strides, padding, compute_dtype, residuals, g):
    x, kernel_q, kernel_scale = residuals
    kernel = dequantize(kernel_q, kernel_scale, x.dtype)
    _, vjp = jax.vjp(lambda x_: _conv(x_, kernel, strides, padding), x)
    (dx,) = vjp(g.astype(x.dtype))
    return dx, np.zeros(kernel_q.shape, jax.dtypes.float0), jnp.zeros_like(kernel_scale)


int8_conv.defvjp(_int8_conv_fwd, _int8_conv_bwd)


def int8_gather(ids: jax.Array, kernel_q: jax.Array, kernel_scale: jax.Array, compute_dtype: Any) -> jax.Array:
    """Rows ``ids`` of an int8 table with one scale per row, dequantized into ``compute_dtype``.

    >>> int8_gather(jnp.array([1]), jnp.array([[1, 2], [3, -4]], jnp.int8), jnp.array([[1.0], [0.5]]), "float32")
    Array([[ 1.5, -2. ]], dtype=float32)
    """
    rows = kernel_q[ids].astype(jnp.float32) * kernel_scale[ids].astype(jnp.float32)
    return rows.astype(compute_dtype)


# --- the mode's entry points (autopolicy.numerics.modes) --------------------------------------


def quantize_weights(kernel: jax.Array, contract_axes: Sequence[int], op: str, policy: Any,
                     scale_dtype: Any) -> dict[str, jax.Array]:
    """The int8 form of a float kernel: ``kernel`` (int8), ``kernel_scale`` and, for einsum
    kernels, ``kernel_colsum`` (measured: recomputing the column sums at every call halves the
    int8 speed-up at 128 rows)."""
    del policy  # int8 has no parameters
    kernel_q, scale = quantize_symmetric(kernel, contract_axes, scale_dtype=scale_dtype)
    arrays = {"kernel": kernel_q, "kernel_scale": scale}
    if op == "einsum":
        arrays["kernel_colsum"] = column_sums(kernel_q, contract_axes)
    return arrays


def einsum_kernel(equation: str, x: jax.Array, weights: dict, layout: tuple, compute_dtype: Any) -> jax.Array:
    del layout
    return int8_einsum(equation, x, weights["kernel"], weights["kernel_scale"], compute_dtype,
                       weights.get("kernel_colsum"))


def conv2d_kernel(x: jax.Array, weights: dict, layout: tuple, compute_dtype: Any,
                  strides: tuple[int, int], padding: str) -> jax.Array:
    del layout
    return int8_conv(x, weights["kernel"], weights["kernel_scale"], strides, padding, compute_dtype)


def gather_kernel(ids: jax.Array, weights: dict, layout: tuple, compute_dtype: Any) -> jax.Array:
    del layout
    return int8_gather(ids, weights["kernel"], weights["kernel_scale"], compute_dtype)
