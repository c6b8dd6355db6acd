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

from autopolicy.numerics import _u8s8_dot
from autopolicy.numerics.device import Device, current_device

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
    alone = [c for c in lhs + rhs if c not in out and (c not in lhs or c not in rhs)]
    if alone:
        raise ValueError(f"int8_einsum sums only over letters of both operands; {alone} of "
                         f"{equation!r} would be summed within one operand.")
    summed = [c for c in lhs if c in rhs and c not in out]
    return tuple(lhs.index(c) for c in summed), tuple(rhs.index(c) for c in summed)


def column_sums(kernel_q: jax.Array, contract_axes: Sequence[int]) -> jax.Array:
    """``128 * sum(kernel_q)`` over the contracted axes, in int32: what shifting the quantized
    inputs by +128 adds to each output, stored once so no call recomputes it.

    >>> column_sums(jnp.array([[1, -2], [3, 4]], jnp.int8), (0,))
    Array([512, 256], dtype=int32)
    """
    return 128 * jnp.sum(kernel_q, axis=tuple(contract_axes), dtype=jnp.int32)


# --- kernels (tactics): every one computes the same int32 accumulators ------------------------

#: The int8 kernels. Each gives the same int32 accumulators, so the same outputs bit for bit:
#: ``"s8s8"`` is XLA's s8 x s8 -> s32 dot; ``"u8s8"`` shifts the inputs by +128 into uint8,
#: multiplies with the u8 x s8 -> s32 dot (:mod:`autopolicy.numerics._u8s8_dot`, the x86
#: VNNI/AMX instruction) and subtracts the stored :func:`column_sums`.
INT8_KERNELS = ("s8s8", "u8s8")
#: The kernels of each op (the u8 x s8 dot is a matrix product, not a convolution).
INT8_OP_KERNELS = (("einsum", ("s8s8", "u8s8")), ("conv2d", ("s8s8",)))


def int8_kernel_available(kernel: str, device: Device) -> bool:
    """Whether ``kernel`` runs on ``device`` natively (so it is worth timing there).

    ``"u8s8"`` is a CPU kernel: elsewhere it would lower to the s8 x s8 dot plus a shift.

    >>> int8_kernel_available("u8s8", Device("cpu", cpu_features=("avx2",)))
    True
    >>> int8_kernel_available("u8s8", Device("gpu", compute_capability="9.0"))
    False
    """
    _check_kernel(kernel, INT8_KERNELS, "einsum")
    if kernel == "u8s8":
        return device.platform == "cpu" and _u8s8_dot.AVAILABLE
    return True


def default_int8_kernel(device: Device | None = None) -> str:
    """The int8 einsum kernel to use without a measurement: ``"u8s8"`` on CPUs with VNNI or AMX
    int8 (where XLA's u8 x s8 dot uses them), ``"s8s8"`` everywhere else (on CPUs without VNNI
    XLA's u8 x s8 dot is several times slower than its s8 x s8 one; GPUs run s8 x s8 natively).

    Args:
      device: The device; None means :func:`~autopolicy.numerics.device.current_device`.

    >>> default_int8_kernel(Device("cpu", cpu_features=("avx2", "fma")))
    's8s8'
    >>> default_int8_kernel(Device("cpu", cpu_features=("avx2", "avx512_vnni"))) == (
    ...     "u8s8" if _u8s8_dot.AVAILABLE else "s8s8")
    True
    """
    device = current_device() if device is None else device
    return "u8s8" if device.has_vnni and int8_kernel_available("u8s8", device) else "s8s8"


def _check_kernel(kernel: Any, valid: tuple[str, ...], op: str) -> None:
    if kernel not in valid:
        raise ValueError(f"Invalid int8 {op} kernel. Expected one of {valid} (or None for the "
                         f"device's default). Received: kernel={kernel!r}")


def _resolve_einsum_kernel(kernel: str | None, equation: str) -> str:
    if kernel is None:
        kernel = default_int8_kernel()
        # The default falls back where the u8 x s8 matrix product cannot express the einsum.
        return kernel if kernel != "u8s8" or _matmul_plan(equation) else "s8s8"
    _check_kernel(kernel, INT8_KERNELS, "einsum")
    if kernel == "u8s8":
        if not _u8s8_dot.AVAILABLE:
            raise ValueError("The int8 kernel 'u8s8' needs JAX's primitive hooks, which this JAX "
                             "version lacks; use kernel='s8s8'.")
        if _matmul_plan(equation) is None:
            raise ValueError(f"The int8 kernel 'u8s8' runs einsums that are one matrix product (no "
                             f"batch axes); {equation!r} is not. Use kernel='s8s8'.")
    return kernel


def _matmul_plan(equation: str) -> tuple[str, str, str] | None:
    """``(free_x, summed, free_k)``: the einsum as ``x[free_x, summed] @ k[summed, free_k]``
    after transposes (letters in the operands' own orders), or None when it is not one product.

    >>> _matmul_plan("abc,cde->abde"), _matmul_plan("bmk,bkn->bmn")
    (('ab', 'c', 'de'), None)
    """
    lhs, rhs, out = _einsum_spec(equation)
    if len(set(lhs)) < len(lhs) or len(set(rhs)) < len(rhs) or len(set(out)) < len(out):
        return None
    summed = "".join(c for c in lhs if c in rhs and c not in out)
    free_x = "".join(c for c in lhs if c not in rhs)
    free_k = "".join(c for c in rhs if c not in lhs)
    if not summed or sorted(out) != sorted(free_x + free_k):
        return None  # a batch axis (in both operands and the output), or one summed away alone
    return free_x, summed, free_k


def _s8s8_accumulate(equation, x_q, kernel_q, kernel_colsum):
    del kernel_colsum
    return jnp.einsum(equation, x_q, kernel_q, preferred_element_type=jnp.int32)


def _u8s8_accumulate(equation, x_q, kernel_q, kernel_colsum):
    """The s8 x s8 accumulators through the u8 x s8 dot: ``(x + 128) @ k - 128 * sum(k)``."""
    lhs, rhs, out = _einsum_spec(equation)
    free_x, summed, free_k = _matmul_plan(equation)
    x_t = jnp.transpose(x_q, [lhs.index(c) for c in free_x + summed])
    k_t = jnp.transpose(kernel_q, [rhs.index(c) for c in summed + free_k])
    rows_shape, cols_shape = x_t.shape[: len(free_x)], k_t.shape[len(summed):]
    k = int(np.prod(x_t.shape[len(free_x):]))
    n = int(np.prod(cols_shape))
    # q ^ 0x80 read as unsigned is q + 128: [-127, 127] -> [1, 255], no arithmetic needed.
    x_u8 = jax.lax.bitcast_convert_type(x_t.reshape((-1, k)) ^ jnp.int8(-128), jnp.uint8)
    rows = x_u8.shape[0]
    if rows == 1:  # YNNPACK's kernel needs two rows; a copy costs less than the slow path.
        x_u8 = jnp.concatenate([x_u8, x_u8])
    if kernel_colsum is None:
        kernel_colsum = column_sums(kernel_q, contracted_axes(equation)[1])
    # The stored column sums keep the kernel's free axes in its own order, as ``k_t`` does.
    acc = _u8s8_dot.u8s8_matmul(x_u8, k_t.reshape((k, n)))[:rows] - kernel_colsum.reshape((n,))
    acc = acc.reshape(rows_shape + cols_shape)
    return jnp.transpose(acc, [(free_x + free_k).index(c) for c in out])


_ACCUMULATE = {"s8s8": _s8s8_accumulate, "u8s8": _u8s8_accumulate}


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


def int8_accumulate(equation: str, x_q: jax.Array, kernel_q: jax.Array, kernel: str | None = None,
                    kernel_colsum: jax.Array | None = None) -> jax.Array:
    """The int32 accumulators ``einsum(equation, x_q, kernel_q)`` of two int8 operands, computed
    by the int8 kernel ``kernel`` (every kernel gives the same values).

    Args:
      equation: A two-operand einsum without ellipsis.
      x_q, kernel_q: int8 operands.
      kernel: One of :data:`INT8_KERNELS`, or None for the device's default.
      kernel_colsum: Optional :func:`column_sums` of ``kernel_q`` (used by ``"u8s8"``).

    Raises:
      ValueError: for an unknown kernel, or ``"u8s8"`` with an einsum that is not one matrix
        product.

    >>> x = jnp.array([[-127, 3]], jnp.int8); k = jnp.array([[2], [127]], jnp.int8)
    >>> [int8_accumulate("mk,kn->mn", x, k, name)[0, 0].item() for name in INT8_KERNELS]
    [127, 127]
    """
    return _ACCUMULATE[_resolve_einsum_kernel(kernel, equation)](equation, x_q, kernel_q, kernel_colsum)


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
    x_axes, _ = contracted_axes(equation)
    x_q, x_scale = quantize_symmetric(x, x_axes)
    acc = int8_accumulate(equation, x_q, kernel_q, kernel, kernel_colsum)
    y = _rescale(equation, acc, x_scale, kernel_scale)
    return y.astype(compute_dtype), (x, kernel_q, kernel_scale, kernel_colsum)


def _is_matmul(equation: str) -> bool:
    """Whether the einsum is ``x[free_x, c] @ kernel[c, free_k]`` as laid out (no transposes)."""
    plan = _matmul_plan(equation)
    if plan is None:
        return False
    lhs, rhs, out = _einsum_spec(equation)
    free_x, summed, free_k = plan
    return lhs == free_x + summed and rhs == summed + free_k and out == free_x + free_k


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
    x2 = x.reshape((-1, x.shape[-1]))
    y = int8_einsum("mk,kn->mn", x2, kernel_q, kernel_scale, compute_dtype, kernel_colsum, kernel)
    return y.reshape(lead + (kernel_q.shape[-1],))


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


def _int8_conv_fwd(x, kernel_q, kernel_scale, strides, padding, compute_dtype, kernel=None):
    if kernel is not None:
        _check_kernel(kernel, dict(INT8_OP_KERNELS)["conv2d"], "conv2d")
    x_q, x_scale = quantize_symmetric(x, axes=(1, 2, 3))
    acc = _conv(x_q, kernel_q, strides, padding, preferred_element_type=jnp.int32)
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
