"""int8 quantization: symmetric abs-max scales, int8 x int8 products with int32 accumulators.

Weights are quantized once, per output channel; inputs are quantized at every call, per row (per
token) over the contracted axes. The product runs on int8 operands with an int32 accumulator and
is rescaled into the compute dtype. Inputs get a straight-through gradient: the gradient of the
same product with the dequantized kernel.

The int32 accumulators come from one of several kernels (:data:`INT8_KERNELS`), chosen by name
(``kernel=``) or, without one, by the device's CPU features (:func:`default_int8_kernel`). The
quantization and the rescale around them are shared code, so every kernel gives the same
output bit for bit; which is fastest is for a measurement on the target to say.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.numerics import _int8_accumulate, _sharding, cpu_kernels
from autopolicy.numerics._int8_accumulate import (  # noqa: F401  (re-exported)
    INT8_KERNELS,
    INT8_OP_KERNELS,
    _check_kernel,
    _einsum_spec,
    _is_matmul,
    column_sums,
    contracted_axes,
    default_int8_kernel,
    int8_accumulate,
    int8_kernel_available,
)

__all__ = [
    "INT8_MAX",
    "quantize_symmetric",
    "dequantize",
    "int8_einsum",
    "int8_conv",
    "int8_dense",
    "int8_gather",
    "int8_accumulate",
    "INT8_KERNELS",
    "INT8_OP_KERNELS",
    "int8_kernel_available",
    "default_int8_kernel",
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
    return _quantize_symmetric(x, _reduce_axes(jnp.ndim(x), axes), jnp.dtype(scale_dtype))


# Jitted: called eagerly (on weights), one compilation per signature instead of one per primitive.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_symmetric(x: jax.Array, axes: tuple[int, ...], scale_dtype: Any) -> tuple[jax.Array, jax.Array]:
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
    # An all-zero slice gets scale 1 (its values quantize to 0 either way).
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(xf * (1.0 / scale)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale.astype(scale_dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``q * scale`` in ``dtype`` (``scale`` broadcasts against ``q``)."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def _rescale(equation: str, acc: jax.Array, x_scale: jax.Array, kernel_scale: jax.Array) -> jax.Array:
    """``acc * (x_scale * kernel_scale)`` in float32, each scale broadcast into the output's
    layout (one multiply per output element; every kernel shares it, so their outputs agree
    bit for bit)."""
    lhs, rhs, out = _einsum_spec(equation)
    x_axes, k_axes = contracted_axes(equation)

    def place(scale, letters, axes):
        kept = "".join(c for i, c in enumerate(letters) if i not in axes)
        scale = jnp.squeeze(scale.astype(jnp.float32), axis=axes)
        order = [c for c in out if c in kept]
        scale = jnp.transpose(scale, [kept.index(c) for c in order])
        return scale.reshape(tuple(scale.shape[order.index(c)] if c in kept else 1 for c in out))

    return acc.astype(jnp.float32) * (place(x_scale, lhs, x_axes) * place(kernel_scale, rhs, k_axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 6))
def int8_einsum(
    equation: str,
    x: jax.Array,
    kernel_q: jax.Array,
    kernel_scale: jax.Array,
    compute_dtype: Any,
    kernel_colsum: jax.Array | None = None,
    kernel: str | None = None,
) -> jax.Array:
    """``einsum(equation, x, kernel)`` with ``x`` quantized per row and an int8 kernel.

    Args:
      equation: A two-operand einsum without ellipsis, e.g. ``"btd,dhk->bthk"``.
      x: The input, in the compute dtype.
      kernel_q: The int8 kernel (from :func:`quantize_symmetric` over the contracted axes).
      kernel_scale: Its scale, with the contracted axes kept as size 1.
      compute_dtype: The dtype of the result.
      kernel_colsum: Optional :func:`column_sums` of the kernel (saves recomputing them on the
        ``"u8s8"`` kernel at every call).
      kernel: The int8 kernel that multiplies, one of :data:`INT8_KERNELS` (a static name; the
        result is the same bit for bit), or None for :func:`default_int8_kernel`.

    Raises:
      ValueError: for an unknown kernel (listing :data:`INT8_KERNELS`).

    >>> x = jnp.array([[1.0, -2.0]]); k = jnp.array([[2], [127]], jnp.int8)
    >>> int8_einsum("mk,kn->mn", x, k, jnp.array([[0.5]]), "float32", kernel="s8s8")
    Array([[-125.99213]], dtype=float32)
    """
    return _int8_einsum_fwd(equation, x, kernel_q, kernel_scale, compute_dtype, kernel_colsum, kernel)[0]


def _int8_einsum_fwd(equation, x, kernel_q, kernel_scale, compute_dtype, kernel_colsum=None, kernel=None):
    residuals = (x, kernel_q, kernel_scale, kernel_colsum)
    if kernel in cpu_kernels.FFI_KERNELS:
        # On a CPU the kernel's call (the quantization and rescale inside it: the same values, or
        # around it), elsewhere the device's XLA kernel.
        def xla(x_, kq, ks):
            return _int8_einsum_fwd(equation, x_, kq, ks, compute_dtype, kernel_colsum)[0]

        def ffi(x_, kq, ks):
            y = _int8_accumulate.ffi_dense(equation, x_, kq, ks, compute_dtype, kernel)
            return _quantized_product(equation, x_, kq, ks, compute_dtype, kernel_colsum, kernel) if y is None else y

        _int8_accumulate._resolve_einsum_kernel(kernel, equation)  # pylint: disable=protected-access  # raises early
        return cpu_kernels.on_cpu(ffi, xla, x, kernel_q, kernel_scale), residuals
    return _quantized_product(equation, x, kernel_q, kernel_scale, compute_dtype, kernel_colsum, kernel), residuals


def _quantized_product(equation, x, kernel_q, kernel_scale, compute_dtype, kernel_colsum, kernel):
    """x quantized per row around the contraction, the int8 kernel's accumulators, rescaled."""
    x_q, x_scale = quantize_symmetric(x, contracted_axes(equation)[0])
    acc = int8_accumulate(equation, x_q, kernel_q, kernel, kernel_colsum)
    return _rescale(equation, acc, x_scale, kernel_scale).astype(compute_dtype)


def _int8_einsum_bwd(equation, compute_dtype, kernel, residuals, g):
    del kernel  # every kernel has the same forward values, so the same gradient
    x, kernel_q, kernel_scale, kernel_colsum = residuals
    kernel_f = dequantize(kernel_q, kernel_scale, x.dtype)
    _, vjp = jax.vjp(lambda x_: jnp.einsum(equation, x_, kernel_f), x)
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
    kernel: str | None = None,
) -> jax.Array:
    """``x @ kernel`` over the last axis of ``x`` with an int8 ``(in, out)`` kernel.

    ``kernel_scale`` has shape ``(1, out)``; ``kernel`` names the int8 kernel (see
    :func:`int8_einsum`).
    """
    lead = x.shape[:-1]
    x2 = _sharding.reshape(x, (-1, x.shape[-1]))
    y = int8_einsum("mk,kn->mn", x2, kernel_q, kernel_scale, compute_dtype, kernel_colsum, kernel)
    return _sharding.reshape(y, lead + (kernel_q.shape[-1],))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def int8_conv(
    x: jax.Array,
    kernel_q: jax.Array,
    kernel_scale: jax.Array,
    strides: tuple[int, int],
    padding: str,
    compute_dtype: Any,
    kernel: str | None = None,
) -> jax.Array:
    """A 2-D NHWC convolution with an int8 HWIO kernel (scale ``(1, 1, 1, O)``).

    Each input example is quantized with one scale (a convolution contracts over a window, so a
    per-pixel scale would not factor out of the sum). ``kernel`` names the int8 kernel: the
    convolution has one, ``"s8s8"`` (None means it).

    Raises:
      ValueError: for any other kernel name.
    """
    return _int8_conv_fwd(x, kernel_q, kernel_scale, strides, padding, compute_dtype, kernel)[0]


def _conv(x, k, strides, padding, **kwargs):
    return jax.lax.conv_general_dilated(
        x, k, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kwargs
    )


def _float_conv_accumulate(x_q, kernel_q, strides, padding):
    """The int32 accumulators of the int8 convolution from a float32 one, where XLA has no integer
    convolution (on GPUs, cuDNN lowers only some layouts of one): every int8 product is exact in
    float32, and so is each sum while it stays below 2**24 in size (any window of at most 1040
    inputs); past that the sums are within float32 rounding of the integer ones."""
    acc = _conv(x_q.astype(jnp.float32), kernel_q.astype(jnp.float32), strides, padding,
                precision=jax.lax.Precision.HIGHEST)
    return acc.astype(jnp.int32)


def _int8_conv_fwd(x, kernel_q, kernel_scale, strides, padding, compute_dtype, kernel=None):
    if kernel is not None:
        _check_kernel(kernel, dict(INT8_OP_KERNELS)["conv2d"], "conv2d")
    x_q, x_scale = quantize_symmetric(x, axes=(1, 2, 3))
    acc = cpu_kernels.on_cpu(lambda a, b: _conv(a, b, strides, padding, preferred_element_type=jnp.int32),
                             lambda a, b: _float_conv_accumulate(a, b, strides, padding), x_q, kernel_q)
    scale = x_scale * kernel_scale.astype(jnp.float32).reshape((1, 1, 1, -1))
    y = (acc.astype(jnp.float32) * scale).astype(compute_dtype)
    return y, (x, kernel_q, kernel_scale)


def _int8_conv_bwd(strides, padding, compute_dtype, kernel, residuals, g):
    del kernel
    x, kernel_q, kernel_scale = residuals
    kernel_f = dequantize(kernel_q, kernel_scale, x.dtype)
    _, vjp = jax.vjp(lambda x_: _conv(x_, kernel_f, strides, padding), x)
    (dx,) = vjp(g.astype(x.dtype))
    return dx, np.zeros(kernel_q.shape, jax.dtypes.float0), jnp.zeros_like(kernel_scale)


int8_conv.defvjp(_int8_conv_fwd, _int8_conv_bwd)


def int8_gather(ids: jax.Array, kernel_q: jax.Array, kernel_scale: jax.Array, compute_dtype: Any) -> jax.Array:
    """Rows ``ids`` of an int8 table with one scale per row, dequantized into ``compute_dtype``.

    >>> int8_gather(jnp.array([1]), jnp.array([[1, 2], [3, -4]], jnp.int8), jnp.array([[1.0], [0.5]]), "float32")
    Array([[ 1.5, -2. ]], dtype=float32)
    """
    rows = (_sharding.take_rows(kernel_q, ids).astype(jnp.float32)
            * _sharding.take_rows(kernel_scale, ids).astype(jnp.float32))
    return rows.astype(compute_dtype)


# --- the mode's entry points (autopolicy.numerics.modes) --------------------------------------


def quantize_weights(kernel: jax.Array, contract_axes: Sequence[int], op: str, policy: Any,
                     scale_dtype: Any) -> dict[str, jax.Array]:
    """The int8 form of a float kernel: ``kernel`` (int8), ``kernel_scale`` and, for einsum
    kernels, ``kernel_colsum`` (measured: recomputing the column sums at every call halves the
    int8 speed-up at 128 rows)."""
    del policy  # int8 has no parameters
    axes = _reduce_axes(jnp.ndim(kernel), contract_axes)
    return _quantize_kernel(kernel, axes, op == "einsum", jnp.dtype(scale_dtype))


# One compilation per kernel signature, not one per primitive as eagerly: measured 3x less CPU
# time for a kernel of a new shape (quantize_symmetric is jitted too, for its other callers).
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_kernel(kernel: jax.Array, axes: tuple[int, ...], colsum: bool, scale_dtype: Any) -> dict:
    kernel_q, scale = quantize_symmetric(kernel, axes, scale_dtype=scale_dtype)
    arrays = {"kernel": kernel_q, "kernel_scale": scale}
    if colsum:
        arrays["kernel_colsum"] = column_sums(kernel_q, axes)
    return arrays


def einsum_kernel(equation: str, x: jax.Array, weights: dict, layout: tuple, compute_dtype: Any,
                  kernel: str | None = None) -> jax.Array:
    """The mode's einsum op; ``kernel`` names the int8 kernel (None: the device's default)."""
    del layout
    return int8_einsum(equation, x, weights["kernel"], weights["kernel_scale"], compute_dtype,
                       weights.get("kernel_colsum"), kernel)


def conv2d_kernel(x: jax.Array, weights: dict, layout: tuple, compute_dtype: Any,
                  strides: tuple[int, int], padding: str, kernel: str | None = None) -> jax.Array:
    """The mode's conv2d op; ``kernel`` names the int8 kernel (only ``"s8s8"``; None means it)."""
    del layout
    return int8_conv(x, weights["kernel"], weights["kernel_scale"], strides, padding, compute_dtype, kernel)


def gather_kernel(ids: jax.Array, weights: dict, layout: tuple, compute_dtype: Any) -> jax.Array:
    del layout
    return int8_gather(ids, weights["kernel"], weights["kernel_scale"], compute_dtype)
