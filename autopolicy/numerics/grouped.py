"""Products that share one input, in one call of autopolicy's CPU kernels.

A decoder block multiplies one normalized input by its query, key and value kernels, and another
by its gate and up kernels. Where those layers hold the same quantized form (int8, or int4 with the
same blocks) and run the same FFI kernel (``"cpu_ffi"`` or ``"cpu_ffi_avx2"``),
:func:`grouped_products` computes them all in one call of
:func:`~autopolicy.numerics.cpu_kernels.int8_dense_group` or
:func:`~autopolicy.numerics.cpu_kernels.int4_dense_group`: the input is quantized once and the
threads share one set of tasks, where separate calls each pay the call's fixed cost and, below
:func:`~autopolicy.numerics.cpu_kernels.serial_max_bytes`, leave the second core idle. The
outputs equal the separate calls' bit for bit; off a CPU, and for gradients, the products run as
the layers' own kernels do.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from autopolicy.numerics import cpu_kernels, int4, int8

__all__ = ["GROUPED_MODES", "GROUPED_ENV", "enabled", "matrix_weights", "grouped_products", "can_group"]

#: The quantization modes whose products group.
GROUPED_MODES = ("int8", "int4")
#: Set to 0 to call every projection on its own (``autopolicy.nn``'s layers; for A/B timing).
GROUPED_ENV = "AUTOPOLICY_GROUPED_PROJECTIONS"


def enabled() -> bool:
    """Whether layers sharing an input may run as one call (``AUTOPOLICY_GROUPED_PROJECTIONS`` is
    not ``0``); read when a call is traced."""
    return os.environ.get(GROUPED_ENV, "").strip() not in ("0", "false", "False")


def can_group(mode: str | None, kernel: str | None, dtype: Any) -> bool:
    """Whether a product of ``mode`` run by ``kernel`` on inputs of ``dtype`` can join a group:
    an int8 or int4 product on an FFI kernel this machine runs, in float32 or bfloat16, with one
    device (arrays sharded over several take the layers' own calls, as the FFI kernels are
    offered on one device only)."""
    if mode not in GROUPED_MODES or kernel not in cpu_kernels.FFI_KERNELS or not cpu_kernels.AVAILABLE:
        return False
    if jax.device_count() != 1:
        return False
    if jnp.dtype(dtype).name not in cpu_kernels.DENSE_DTYPES:
        return False
    try:
        cpu_kernels.kernel_path(kernel)
    except ValueError:
        return False
    return True


def matrix_weights(mode: str, weights: dict, contracted: int) -> tuple[dict, tuple[int, ...]]:
    """A layer's stored ``mode`` weights as the ``(K, N)`` matrix product's, and the shape of its
    output axes (``N`` unflattened). ``contracted``: how many leading axes of the float kernel the
    product sums over (int4 stores them flattened into one already).

    Raises:
      ValueError: for a mode that does not group.
    """
    if mode == "int8":
        kernel = weights["kernel"]
        outs = tuple(kernel.shape[contracted:])
        n = math.prod(outs)
        mats = {"kernel": kernel.reshape((-1, n)), "kernel_scale": weights["kernel_scale"].reshape((1, n))}
        if weights.get("kernel_colsum") is not None:
            mats["kernel_colsum"] = weights["kernel_colsum"].reshape((n,))
        return mats, outs
    if mode == "int4":
        kernel = weights["kernel"]
        outs = tuple(kernel.shape[1:])
        n = math.prod(outs)
        return {name: weights[name].reshape((weights[name].shape[0], n))
                for name in ("kernel", "kernel_scale", "kernel_colsum")}, outs
    raise ValueError(f"Invalid grouped mode. Expected one of {GROUPED_MODES}. Received: {mode!r}")


def _separate(mode: str, layout: tuple, compute_dtype: Any, kernel: str, x2: jax.Array, mats: Sequence[dict]):
    """The products one by one, as each layer's own kernel runs them."""
    fn = int8.einsum_kernel if mode == "int8" else int4.einsum_kernel
    return tuple(fn("mk,kn->mn", x2, weights=w, layout=layout, compute_dtype=compute_dtype, kernel=kernel)
                 for w in mats)


def _one_call(mode: str, layout: tuple, compute_dtype: Any, kernel: str, x2: jax.Array, mats: Sequence[dict]):
    simd_path = cpu_kernels.kernel_path(kernel)
    if mode == "int8":
        return cpu_kernels.int8_dense_group(x2, [(w["kernel"], w["kernel_scale"].astype(jnp.float32)) for w in mats],
                                            out_dtype=compute_dtype, simd_path=simd_path)
    (block_size,) = layout
    block = x2.shape[1] if block_size == int4.PER_CHANNEL else block_size
    return cpu_kernels.int4_dense_group(x2, [(w["kernel"], w["kernel_scale"].astype(jnp.float32)) for w in mats],
                                        block, out_dtype=compute_dtype, simd_path=simd_path)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _grouped(mode, layout, compute_dtype, kernel, x2, mats):
    return _grouped_fwd(mode, layout, compute_dtype, kernel, x2, mats)[0]


def _grouped_fwd(mode, layout, compute_dtype, kernel, x2, mats):
    def call(x_, mats_):
        return _one_call(mode, layout, compute_dtype, kernel, x_, mats_)

    def separate(x_, mats_):
        return _separate(mode, layout, compute_dtype, kernel, x_, mats_)

    # On a CPU the one call, elsewhere the layers' own products (no FFI target there): the same values.
    return cpu_kernels.on_cpu(call, separate, x2, tuple(mats)), (x2, tuple(mats))


def _grouped_bwd(mode, layout, compute_dtype, kernel, residuals, g):
    # The separate products' gradients (each layer's straight-through rule).
    x2, mats = residuals
    _, vjp = jax.vjp(lambda x_, m_: _separate(mode, layout, compute_dtype, kernel, x_, m_), x2, mats)
    return vjp(tuple(g))


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_products(mode: str, layout: tuple, compute_dtype: Any, kernel: str, x2: jax.Array,
                     mats: Sequence[dict]) -> tuple[jax.Array, ...]:
    """``x2 @ w`` for each of ``mats`` (``mode`` weights in the form :func:`matrix_weights` gives,
    all of one ``layout``), in ``compute_dtype``, as one call of the CPU kernels' grouped target
    on ``kernel`` (``"cpu_ffi"`` or ``"cpu_ffi_avx2"``); equal bit for bit to each product run by
    ``mode``'s own einsum kernel, whose gradients it has.

    Raises:
      ValueError: for a mode that does not group, a kernel that is not an FFI kernel this machine
        runs, several devices, or an input that is not a 2-D float32 or bfloat16 array.
    """
    if not can_group(mode, kernel, x2.dtype) or x2.ndim != 2:
        raise ValueError(f"grouped_products: needs a mode of {GROUPED_MODES}, an FFI kernel this machine runs "
                         f"(of {tuple(cpu_kernels.FFI_KERNELS)}), one device and a 2-D input of "
                         f"{cpu_kernels.DENSE_DTYPES}. Received: mode={mode!r}, kernel={kernel!r}, "
                         f"x {x2.dtype}{list(x2.shape)}, {jax.device_count()} device(s)")
    return _grouped(mode, tuple(layout), jnp.dtype(compute_dtype), kernel, x2, tuple(mats))
