"""The int32 accumulators of an int8 einsum, computed by one of several kernels (tactics).

Every kernel gives the same accumulators, so :mod:`autopolicy.numerics.int8` (which quantizes
the input before and rescales after, the same way for all) gives the same output bit for bit
whichever runs. Which is fastest depends on the CPU: a measurement on the target decides, and
without one :func:`default_int8_kernel` follows the CPU's features.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.numerics import _sharding, _u8s8_dot, cpu_kernels
from autopolicy.numerics.device import Device, current_device

__all__ = [
    "INT8_KERNELS",
    "INT8_OP_KERNELS",
    "contracted_axes",
    "column_sums",
    "int8_accumulate",
    "int8_kernel_available",
    "default_int8_kernel",
]


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


#: The int8 kernels. Each gives the same int32 accumulators, so the same outputs bit for bit:
#: ``"s8s8"`` is XLA's s8 x s8 -> s32 dot; ``"u8s8"`` shifts the inputs by +128 into uint8,
#: multiplies with the u8 x s8 -> s32 dot (:mod:`autopolicy.numerics._u8s8_dot`, the x86
#: VNNI/AMX instruction) and subtracts the stored :func:`column_sums`; ``"cpu_ffi"`` is
#: autopolicy's own CPU kernel (:mod:`autopolicy.numerics.cpu_kernels`, an XLA FFI call) on the
#: CPU's best SIMD path, ``"cpu_ffi_avx2"`` the same library on its AVX2 path (a tactic of its own
#: on CPUs whose best path is another: :data:`~autopolicy.numerics.cpu_kernels.FFI_KERNELS`).
INT8_KERNELS = ("s8s8", "u8s8", "cpu_ffi", "cpu_ffi_avx2")
#: The kernels of each op (the u8 x s8 dot and the FFI kernel are matrix products, not
#: convolutions).
INT8_OP_KERNELS = (("einsum", ("s8s8", "u8s8", "cpu_ffi", "cpu_ffi_avx2")), ("conv2d", ("s8s8",)))


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
    if kernel in cpu_kernels.FFI_KERNELS:
        return ffi_available(device) and cpu_kernels.kernel_distinct_on(kernel, device.cpu_features)
    return True


def ffi_available(device: Device) -> bool:
    """Whether autopolicy's CPU kernels run on ``device``: a CPU, the library built and loaded,
    and one device (arrays sharded over several take the XLA kernels)."""
    if device.platform != "cpu" or not cpu_kernels.AVAILABLE:
        cpu_kernels.notice_once()
        return False
    return jax.device_count() == 1


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
    if kernel in cpu_kernels.FFI_KERNELS:
        if not cpu_kernels.AVAILABLE:
            raise ValueError(f"The int8 kernel {kernel!r} is not available here: "
                             f"{cpu_kernels.unavailable_reason()}. Use kernel='s8s8'.")
        if _matmul_plan(equation) is None:
            raise ValueError(f"The int8 kernel {kernel!r} runs einsums that are one matrix product (no "
                             f"batch axes); {equation!r} is not. Use kernel='s8s8'.")
        cpu_kernels.kernel_path(kernel)  # a path this CPU cannot run raises here
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
    """XLA's s8 x s8 -> s32 einsum; off a CPU, a contraction whose length is not a multiple of 4
    sums in a float32 einsum instead (:func:`float_accumulate`). On an H200 (jax 0.11.2) XLA:GPU's
    int8 dot of (5, K) x (K, 7) was wrong for every K from 2 to 19 that is not a multiple of 4
    (outputs twice the true sums), and exact for 1, 4, 8, ..., 20, 48, 130 and 576 (checked against
    numpy's int64 sums; see CHANGELOG.md, 0.2.0). How far past 19 the fault reaches is unknown, so
    every such length takes the float32 dot (130 too); it is exact while the sums stay below 2**24
    (any contraction of up to 1040 values)."""
    del kernel_colsum
    if int(np.prod([x_q.shape[a] for a in contracted_axes(equation)[0]])) % 4 == 0:
        return jnp.einsum(equation, x_q, kernel_q, preferred_element_type=jnp.int32,
                          out_sharding=_sharding.out_sharding(equation, x_q, kernel_q))
    return integer_on_cpu(equation, x_q, kernel_q)


def integer_on_cpu(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """The int32 ``einsum(equation, a, b)`` of two integer operands: XLA's integer dot where the
    program is lowered for a CPU, :func:`float_accumulate` elsewhere."""
    out_sharding = _sharding.out_sharding(equation, a, b)

    def integer(a_, b_):
        return jnp.einsum(equation, a_, b_, preferred_element_type=jnp.int32, out_sharding=out_sharding)

    return cpu_kernels.on_cpu(integer, lambda a_, b_: float_accumulate(equation, a_, b_, out_sharding), a, b)


def float_accumulate(equation: str, a: jax.Array, b: jax.Array, out_sharding: Any = None) -> jax.Array:
    """The int32 ``einsum(equation, a, b)`` of two integer operands from a float32 einsum at
    ``HIGHEST`` precision: exact while every partial sum stays below 2**24 in size, within float32
    rounding of the integer sums past that."""
    acc = jnp.einsum(equation, a.astype(jnp.float32), b.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST, out_sharding=out_sharding)
    return acc.astype(jnp.int32)


def _u8s8_accumulate(equation, x_q, kernel_q, kernel_colsum):
    """The s8 x s8 accumulators through the u8 x s8 dot: ``(x + 128) @ k - 128 * sum(k)``."""
    x2, k2, back = _as_matmul(equation, x_q, kernel_q)
    # q ^ 0x80 read as unsigned is q + 128: [-127, 127] -> [1, 255], no arithmetic needed.
    x_u8 = jax.lax.bitcast_convert_type(x2 ^ jnp.int8(-128), jnp.uint8)
    rows = x_u8.shape[0]
    if rows == 1:  # YNNPACK's kernel needs two rows; a copy costs less than the slow path.
        x_u8 = jnp.concatenate([x_u8, x_u8])
    if kernel_colsum is None:
        kernel_colsum = column_sums(kernel_q, contracted_axes(equation)[1])
    # The stored column sums keep the kernel's free axes in its own order, as ``k2`` does.
    return back(_u8s8_dot.u8s8_matmul(x_u8, k2)[:rows] - kernel_colsum.reshape((k2.shape[1],)))


def _as_matmul(equation, x_q, kernel_q):
    """The einsum's operands as ``(rows, K)`` and ``(K, N)``, and how to put the product back."""
    lhs, rhs, out = _einsum_spec(equation)
    free_x, summed, free_k = _matmul_plan(equation)
    x_t = jnp.transpose(x_q, [lhs.index(c) for c in free_x + summed])
    k_t = jnp.transpose(kernel_q, [rhs.index(c) for c in summed + free_k])
    rows_shape, cols_shape = x_t.shape[: len(free_x)], k_t.shape[len(summed):]
    k = int(np.prod(x_t.shape[len(free_x):]))
    n = int(np.prod(cols_shape))

    def back(acc):
        acc = _sharding.reshape(acc, rows_shape + cols_shape)
        return jnp.transpose(acc, [(free_x + free_k).index(c) for c in out])

    return _sharding.reshape(x_t, (-1, k)), _sharding.reshape(k_t, (k, n)), back


def _ffi_accumulate(equation, x_q, kernel_q, kernel_colsum, kernel="cpu_ffi"):
    del kernel_colsum
    simd_path = cpu_kernels.kernel_path(kernel)

    def ffi(a, b):
        x2, k2, back = _as_matmul(equation, a, b)
        return back(cpu_kernels.int8_matmul(x2, k2, simd_path))

    # Off a CPU (no FFI target there), XLA's s8 x s8 product: the same accumulators.
    return cpu_kernels.on_cpu(ffi, lambda a, b: _s8s8_accumulate(equation, a, b, None), x_q, kernel_q)


def ffi_dense(equation: str, x: jax.Array, kernel_q: jax.Array, kernel_scale: jax.Array,
              compute_dtype: Any, kernel: str = "cpu_ffi") -> jax.Array | None:
    """The whole int8 einsum (quantize ``x``, multiply, rescale) as one call of the CPU kernels'
    fused :func:`~autopolicy.numerics.cpu_kernels.int8_dense`, equal bit for bit to the XLA
    quantization and rescale around the ``kernel`` accumulators (``"cpu_ffi"`` or
    ``"cpu_ffi_avx2"``); None where it does not apply (an input or compute dtype other than float32
    and bfloat16: the caller takes the unfused path).

    Raises:
      ValueError: as :func:`int8_accumulate` with that kernel (not built, not one product, a path
        this CPU cannot run).
    """
    _resolve_einsum_kernel(kernel, equation)
    dtypes = cpu_kernels.DENSE_DTYPES
    if jnp.dtype(x.dtype).name not in dtypes or jnp.dtype(compute_dtype).name not in dtypes:
        return None
    lhs, rhs, out = _einsum_spec(equation)
    _, summed, free_k = _matmul_plan(equation)
    x2, k2, back = _as_matmul(equation, x, kernel_q)
    # The scale keeps the kernel's layout (contracted axes of size 1): its columns in k2's order.
    w_scale = jnp.transpose(kernel_scale.astype(jnp.float32), [rhs.index(c) for c in summed + free_k])
    return back(cpu_kernels.int8_dense(x2, k2, w_scale.reshape((k2.shape[1],)), out_dtype=compute_dtype,
                                       simd_path=cpu_kernels.kernel_path(kernel)))


_ACCUMULATE = {"s8s8": _s8s8_accumulate, "u8s8": _u8s8_accumulate, "cpu_ffi": _ffi_accumulate,
               "cpu_ffi_avx2": functools.partial(_ffi_accumulate, kernel="cpu_ffi_avx2")}


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
    >>> runs = ("",) + (cpu_kernels.supported_paths() if cpu_kernels.AVAILABLE else ())
    >>> {int8_accumulate("mk,kn->mn", x, k, name)[0, 0].item() for name in INT8_KERNELS
    ...  if name not in cpu_kernels.FFI_KERNELS or cpu_kernels.AVAILABLE and cpu_kernels.FFI_KERNELS[name] in runs}
    {127}
    """
    return _ACCUMULATE[_resolve_einsum_kernel(kernel, equation)](equation, x_q, kernel_q, kernel_colsum)


def _is_matmul(equation: str) -> bool:
    """Whether the einsum is ``x[free_x, c] @ kernel[c, free_k]`` as laid out (no transposes)."""
    plan = _matmul_plan(equation)
    if plan is None:
        return False
    lhs, rhs, out = _einsum_spec(equation)
    free_x, summed, free_k = plan
    return lhs == free_x + summed and rhs == summed + free_k and out == free_x + free_k
