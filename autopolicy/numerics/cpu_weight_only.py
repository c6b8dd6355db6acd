"""The GPTQ and AWQ product on autopolicy's CPU kernels (kernel ``"cpu_ffi"`` of those modes).

The XLA path of :mod:`autopolicy.numerics.weight_only` dequantizes the whole kernel and then
multiplies in float: at batch 1 that writes and reads a float kernel for every call. The FFI
kernel (``autopolicy/numerics/cpu/weight_only_*.cc``) reads the stored bytes once instead: per
output row ``n`` and group ``g`` of inputs it sums ``x[k] * q[n, k]`` over the group, then adds
``scale[n, g] * (that - zero[n, g] * sum_g x)``, with the sums of ``x`` over each group
computed once per call. AWQ's channel scales are folded into the inputs (``x / awq_scales``,
the same product as the XLA path's kernel divided by them). Inputs of another float dtype
(bfloat16) are multiplied in float32 and the result is cast back.

Accuracy: the result differs from the XLA path's by float32 rounding only, of the order of
``1e-6 * sum_k |x[k]| * scale[n, g(k)] * (q[n, k] + zero[n, g(k)])`` (the terms the kernel
sums; the tests hold it to 1e-5 of that).

A ``g_idx`` that is not ``k // group_size`` (GPTQ's act-order assigns inputs to groups out of
order) is seen by the kernel, which then dequantizes each weight with its own group's scale and
zero point (plain C++ on every path: the XLA path's math, the stored bytes still read once). The
check is in the kernel because ``g_idx`` is an array: choosing the XLA path on the device
(``lax.cond``) cost about 10 us a call at 576 x 576, a millisecond per SmolLM2 decode step.
Fallbacks to the XLA path, chosen while tracing: operands laid out over several devices, and
einsums that are not one product ``x[..., k] @ kernel[k, n]``. Gradients flow to the inputs
through the XLA path (a custom VJP); the quantized weights get none.

>>> AVAILABLE in (True, False)
True
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.numerics import _int8_accumulate, _sharding, cpu_kernels, weight_only
from autopolicy.numerics.device import Device

__all__ = ["AVAILABLE", "WEIGHT_ONLY_KERNELS", "unavailable_reason", "variant", "kernel_available",
           "weight_only_matmul", "einsum_kernel"]

#: The kernels of the GPTQ and AWQ modes: ``"xla"`` (dequantize, then XLA's float product),
#: ``"cpu_ffi"`` (this module, on the path in use), ``"cpu_ffi_avx2"`` (this module on the AVX2
#: path: :data:`autopolicy.numerics.cpu_kernels.FFI_KERNELS`) and ``"pallas"`` (the Pallas kernel
#: for GPUs, :mod:`autopolicy.numerics.pallas_weight_only`).
WEIGHT_ONLY_KERNELS = ("xla", *cpu_kernels.FFI_KERNELS, "pallas")
_TARGET = "autopolicy_weight_only_matmul"
_SYMBOL = "AutopolicyWeightOnlyMatmul"


@functools.lru_cache(maxsize=None)
def _register() -> str | None:
    """Registers the FFI target once; returns why it cannot be, or None."""
    if not cpu_kernels.AVAILABLE:
        return cpu_kernels.unavailable_reason()
    try:
        symbol = getattr(ctypes.CDLL(cpu_kernels.library_path()), _SYMBOL)
    except (OSError, AttributeError) as e:
        return f"the built library has no weight-only kernel ({e}); rebuild with `pip install -e .`"
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(symbol), platform="cpu")
    return None


AVAILABLE = _register() is None


def unavailable_reason() -> str | None:
    """Why the weight-only kernel is not available, or None when it is."""
    return _register()


def variant() -> str:
    """The variant of the weight-only kernel that runs: ``"avx512"``, ``"avx2"`` or ``"portable"``
    (the one in the dispatch table's entry of the path in use); raises RuntimeError when the
    kernel is not available."""
    if not AVAILABLE:
        raise RuntimeError(f"the weight-only CPU kernel is not available: {unavailable_reason()}")
    fn = ctypes.CDLL(cpu_kernels.library_path()).autopolicy_cpu_weight_only_variant
    fn.restype = ctypes.c_char_p
    return fn().decode()


def kernel_available(kernel: str, device: Device) -> bool:
    """Whether the GPTQ/AWQ ``kernel`` is worth timing on ``device``.

    >>> kernel_available("xla", Device("gpu", compute_capability="9.0"))
    True
    >>> kernel_available("cpu_ffi", Device("gpu", compute_capability="9.0"))
    False

    ``"cpu_ffi_avx2"`` only where the CPU's best path is another (see
    :func:`autopolicy.numerics.cpu_kernels.kernel_distinct_on`); ``"pallas"`` only on GPUs.
    """
    _check_kernel(kernel)
    if kernel == "pallas":
        from autopolicy.numerics import pallas_weight_only  # pylint: disable=import-outside-toplevel

        return pallas_weight_only.kernel_available(device)
    return kernel == "xla" or (AVAILABLE and _int8_accumulate.ffi_available(device)
                               and cpu_kernels.kernel_distinct_on(kernel, device.cpu_features))


def _check_kernel(kernel: Any) -> None:
    if kernel not in WEIGHT_ONLY_KERNELS:
        raise ValueError(f"Invalid GPTQ/AWQ kernel. Expected one of {WEIGHT_ONLY_KERNELS}. Received: kernel={kernel!r}")


def weight_only_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array, bits: int,
                       group: int, g_idx: jax.Array | None = None, simd_path: str = "") -> jax.Array:
    """``x @ W^T`` ``(M, N)`` float32 for float32 ``x`` ``(M, K)`` and the weights
    ``W[n, k] = scale[n, g] * (q[n, k] - zero[n, g])``, ``g = g_idx[k]`` (by default ``k // group``).

    Args:
      x: float32 ``(M, K)``.
      q: uint8 grid values: ``bits=4``, packed two a byte along the outputs, ``(ceil(N/2), K)``
        (:func:`autopolicy.numerics.weight_only.pack`); ``bits=8``, one a byte, ``(N, K)``.
      scale: float32 ``(N, G)``, ``G = ceil(K / group)``.
      zero: uint8 ``(N, G)``.
      bits: 4 (packed) or 8 (one value a byte: 2-, 3- and 8-bit weights).
      group: Inputs per group, in ``[1, K]`` (``K``: one group, per channel).
      g_idx: float32 ``(K,)``, each input's group (whole numbers in ``[0, G)``; checked by the
        kernel, which fails naming the first bad entry); None: ``k // group``.
      simd_path: The SIMD path to run: ``""``, the one in use, or one of
        :func:`autopolicy.numerics.cpu_kernels.supported_paths`.

    Raises:
      ValueError: naming the operand of the wrong rank, dtype or shape, a bad ``bits`` or
        ``group``, or a path this CPU cannot run.
      RuntimeError: when the kernel is not available (see :func:`unavailable_reason`).
    """
    if bits not in (4, 8):
        raise ValueError(f"Invalid bits. Expected one of (4, 8). Received: bits={bits!r}")
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"weight_only_matmul: x must be a 2-D float32 array. Received: {x.dtype}{list(x.shape)}")
    m, k = x.shape
    if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= max(k, 1):
        raise ValueError(f"weight_only_matmul: group must be an int in [1, {k}]. Received: group={group!r}")
    n, groups = scale.shape[0] if scale.ndim == 2 else -1, -(-k // group)
    if g_idx is None:
        g_idx = jnp.asarray(weight_only.group_index(k, group))
    expected = {"q": (((n + 1) // 2 if bits == 4 else n, k), jnp.uint8), "scale": ((n, groups), jnp.float32),
                "zero": ((n, groups), jnp.uint8), "g_idx": ((k,), jnp.float32)}
    for name, array in (("scale", scale), ("q", q), ("zero", zero), ("g_idx", g_idx)):
        shape, dtype = expected[name]
        if tuple(array.shape) != shape or array.dtype != dtype:
            raise ValueError(f"weight_only_matmul: {name} must be {jnp.dtype(dtype).name}{list(shape)} (x is "
                             f"{list(x.shape)}, bits={bits}, group={group}). Received: {array.dtype}{list(array.shape)}")
    reason = _register()
    if reason is not None:
        raise RuntimeError(f"autopolicy's weight-only CPU kernel is not available: {reason}.")
    path = cpu_kernels._path_attr(simd_path)  # pylint: disable=protected-access
    out = jax.ShapeDtypeStruct((m, n), jnp.float32)
    return jax.ffi.ffi_call(_TARGET, out)(x, q, scale, zero, g_idx, bits=np.int64(bits), group=np.int64(group),
                                          path=path)


def _plan(equation: str) -> bool:
    """Whether the einsum is ``x[..., k] @ kernel[k, n]`` as laid out (no transposes).

    >>> _plan("mk,kn->mn"), _plan("abc,cd->abd"), _plan("mk,nk->mn")
    (True, True, False)
    """
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    return (len(rhs) == 2 and len(set(lhs + rhs[1])) == len(lhs) + 1 and lhs[-1:] == rhs[0]
            and out == lhs[:-1] + rhs[1])


def _sharded(tree: Any) -> bool:
    if _sharding.spans_devices(tree):
        return True
    if _sharding.explicit_mesh() is None:
        return False
    return any(any(e is not None for e in _sharding.spec_of(leaf)) for leaf in jax.tree_util.tree_leaves(tree))


def _ffi_product(x2: jax.Array, weights: dict, layout: tuple, simd_path: str) -> jax.Array:
    """The FFI product of rows ``x2`` ``(M, K)``, float32 ``(M, N)``, on ``simd_path``."""
    bits, group_size = layout
    k = x2.shape[1]
    xf = x2.astype(jnp.float32)
    if weights.get("awq_scales") is not None:
        xf = xf / weights["awq_scales"].astype(jnp.float32)
    group = k if group_size == weight_only.PER_CHANNEL else min(group_size, k)
    return weight_only_matmul(xf, weights["kernel"], weights["kernel_scale"].astype(jnp.float32),
                              weights["kernel_zero"], 4 if bits == 4 else 8, group,
                              weights["g_idx"].astype(jnp.float32), simd_path)


def _xla_product(x2: jax.Array, weights: dict, layout: tuple, compute_dtype: Any) -> jax.Array:
    return jnp.matmul(x2, weight_only.dequantize(weights, layout, compute_dtype)).astype(compute_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _product(x2: jax.Array, weights: dict, layout: tuple, compute_dtype: Any, simd_path: str) -> jax.Array:
    """The FFI product in the compute dtype (the gradient: the XLA path's)."""
    return _ffi_product(x2, weights, layout, simd_path).astype(compute_dtype)


def _product_fwd(x2, weights, layout, compute_dtype, simd_path):
    return _product(x2, weights, layout, compute_dtype, simd_path), (x2, weights)


def _product_bwd(layout, compute_dtype, simd_path, residuals, g):
    del simd_path  # every path gives the same values (to float32 rounding): one gradient
    x2, weights = residuals
    _, vjp = jax.vjp(lambda x_: _xla_product(x_, weights, layout, compute_dtype), x2)
    (dx,) = vjp(g)
    # The quantized weights are not trained: no gradient flows to them.
    return dx, weight_only.no_gradient(weights)


_product.defvjp(_product_fwd, _product_bwd)


def einsum_kernel(equation: str, x: jax.Array, weights: dict, layout: tuple, compute_dtype: Any,
                  kernel: str | None = "cpu_ffi") -> jax.Array:
    """The GPTQ/AWQ einsum op on the FFI kernel ``kernel`` (``"cpu_ffi"`` or ``"cpu_ffi_avx2"``;
    the XLA path where it does not apply: see the module docstring).

    Raises:
      ValueError: for a kernel that is not an FFI kernel (the XLA op is
        :func:`autopolicy.numerics.weight_only.einsum_kernel`), when the library is missing, or for
        a path this CPU cannot run.
      autopolicy.numerics.weight_only.UncalibratedError: if the weights were never calibrated.
    """
    if kernel not in cpu_kernels.FFI_KERNELS:
        raise ValueError(f"cpu_weight_only.einsum_kernel runs the FFI kernels {tuple(cpu_kernels.FFI_KERNELS)} "
                         f"only. Received: kernel={kernel!r}")
    if not AVAILABLE:
        raise ValueError(f"The GPTQ/AWQ kernel {kernel!r} is not available here: {unavailable_reason()}. "
                         "Use kernel='xla'.")
    simd_path = cpu_kernels.kernel_path(kernel)
    if not weight_only.is_calibrated(weights):
        return weight_only.einsum_kernel(equation, x, weights, layout, compute_dtype)  # raises, naming why
    eq = equation.replace(" ", "")
    if not _plan(eq) or _sharded((x, weights)):
        return weight_only.einsum_kernel(eq, x, weights, layout, compute_dtype)
    weights = {name: value for name, value in weights.items() if value is not None}
    x2 = x.reshape((-1, x.shape[-1]))
    y2 = _product(x2, weights, tuple(layout), jnp.dtype(compute_dtype), simd_path)
    return y2.reshape(x.shape[:-1] + (y2.shape[-1],))
