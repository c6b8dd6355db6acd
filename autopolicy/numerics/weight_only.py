"""Weight-only quantization with asymmetric group scales: the storage and kernel GPTQ and AWQ share.

A float kernel ``(K, N)`` (``K`` inputs, ``N`` outputs) is quantized as Keras 3.15 lays out its
GPTQ and AWQ Dense variables, transposed to ``(N, K)``:

- ``kernel``: uint8 values in ``[0, 2**bits - 1]``, ``(N, K)``; 4-bit values packed two a byte
  along the output axis with :func:`autopolicy.numerics.int4.pack_int4`'s layout (byte row ``j``
  holds rows ``2j`` and ``2j + 1``), so ``(ceil(N/2), K)``, as Keras packs them.
- ``kernel_scale``: ``(N, G)`` in the variable dtype; ``kernel_zero``: ``(N, G)`` uint8, with
  ``G = ceil(K / group_size)`` groups of consecutive inputs (1 for ``group_size=-1``).
- ``g_idx``: ``(K,)`` float32, the group of each input (Keras's dtype); with GPTQ's act-order
  the groups follow the order the columns were quantized in, so ``g_idx`` is not monotone.
- ``awq_scales`` (AWQ only): ``(K,)`` in the variable dtype; the dequantized kernel is divided
  by them per input, as Keras's ``_awq_call`` does.

A weight is ``scale * (q - zero)`` of its output row and input's group. Scales and zero points
cover each group's range extended to include 0 (as GPTQ's reference quantizer does), so 0 is
on the grid and a zero point always fits in ``[0, 2**bits - 1]``. Inputs stay in float: the
kernel is dequantized to the compute dtype and multiplied (correct and jittable; no integer
product). Until calibration (``autopolicy.nn.calibrate_weights``) a layer holds its float kernel
and the state is ``None``; running it then raises.

The kernels' ``layout`` is ``(bits, group_size)``, or ``(bits, group_size, in_order)`` once the
weights are known (:func:`calibrated_layout`): ``in_order`` says that ``g_idx`` is
:func:`group_index`, every input ``k`` in group ``k // group_size``. It is decided where ``g_idx``
is a concrete array (at calibration and loading), never under ``jit``. With it the XLA path
repeats each group's scale and zero point over the group's inputs by a broadcast and a reshape;
without it (act-order, or not known) it gathers them by ``g_idx``. The weights are the same bit
for bit; the broadcast form keeps the dequantization fusable into a GPU GEMM (XLA:GPU's Triton
GEMM fusions take no gather).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.numerics import cpu_kernels, int4

__all__ = [
    "PER_CHANNEL",
    "no_gradient",
    "group_count",
    "group_index",
    "group_params",
    "quantize_to_grid",
    "dequantize_grid",
    "round_to_nearest",
    "pack",
    "unpack",
    "dequantize",
    "store",
    "placeholders",
    "layout_of",
    "in_natural_order",
    "calibrated_layout",
    "is_calibrated",
    "uncalibrated_weights",
    "einsum_kernel",
    "UncalibratedError",
]

#: The group size that means one group per output channel (Keras's ``-1``).
PER_CHANNEL = -1


class UncalibratedError(ValueError):
    """A GPTQ or AWQ layer was run before its weights were calibrated."""


def group_count(k: int, group_size: int) -> int:
    """Groups per output over ``k`` inputs.

    >>> group_count(300, 128), group_count(300, PER_CHANNEL)
    (3, 1)
    """
    return 1 if group_size == PER_CHANNEL else math.ceil(k / group_size)


def group_index(k: int, group_size: int) -> np.ndarray:
    """Keras's ``g_idx`` for inputs in their natural order: ``(k,)`` float32.

    >>> group_index(5, 2)
    array([0., 0., 1., 1., 2.], dtype=float32)
    """
    size = k if group_size == PER_CHANNEL else group_size
    return (np.arange(k) // size).astype(np.float32)


def group_params(w: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """Asymmetric scale and zero point of each row of ``w`` ``(N, k)`` over its ``k`` entries.

    The range is extended to include 0; an all-zero row gets scale 1. Returns float32
    ``(scale, zero)`` of shape ``(N,)``, ``zero`` an integer in ``[0, 2**bits - 1]``.

    >>> s, z = group_params(jnp.array([[-1.0, 2.0], [0.5, 1.5]]), 2)
    >>> s.tolist(), z.tolist()
    ([1.0, 0.5], [1.0, 0.0])
    """
    maxq = 2**bits - 1
    w = w.astype(jnp.float32)
    low = jnp.minimum(jnp.min(w, axis=1), 0.0)
    high = jnp.maximum(jnp.max(w, axis=1), 0.0)
    scale = (high - low) / maxq
    scale = jnp.where(scale > 0, scale, 1.0)
    zero = jnp.clip(jnp.round(-low / scale), 0, maxq)
    return scale, zero


def quantize_to_grid(w: jax.Array, scale: jax.Array, zero: jax.Array, bits: int) -> jax.Array:
    """``clip(round(w / scale) + zero, 0, 2**bits - 1)`` as float32 (broadcasting)."""
    return jnp.clip(jnp.round(w / scale) + zero, 0, 2**bits - 1)


def dequantize_grid(q: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
    return scale * (q - zero)


@functools.partial(jax.jit, static_argnums=(1, 2))
def round_to_nearest(w_t: jax.Array, bits: int, group_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain round-to-nearest of ``w_t`` ``(N, K)`` with one scale and zero per group: the
    baseline GPTQ and AWQ improve on (and AWQ's quantizer once its channels are scaled).

    Returns:
      ``(q, scale, zero)``: ``q`` ``(N, K)`` float32 on the grid; ``scale`` and ``zero``
      ``(N, G)`` float32.
    """
    n, k = w_t.shape
    size = k if group_size == PER_CHANNEL else group_size
    groups = group_count(k, group_size)
    padded = jnp.pad(w_t.astype(jnp.float32), [(0, 0), (0, groups * size - k)])
    blocks = jnp.transpose(padded.reshape(n, groups, size), (1, 0, 2))  # (G, N, size)
    scale, zero = jax.vmap(lambda b: group_params(b, bits))(blocks)  # (G, N) each
    q = quantize_to_grid(blocks, scale[..., None], zero[..., None], bits)
    q = jnp.transpose(q, (1, 0, 2)).reshape(n, groups * size)[:, :k]
    return q, scale.T, zero.T


def pack(q: jax.Array, bits: int) -> jax.Array:
    """uint8 storage of grid values ``q`` ``(N, K)``: 4-bit packed two a byte along ``N``."""
    q = jnp.asarray(q).astype(jnp.uint8)
    if bits != 4:
        return q
    return int4.pack_int4(jax.lax.bitcast_convert_type(q, jnp.int8))


def unpack(stored: jax.Array, n: int, bits: int) -> jax.Array:
    """The ``(n, K)`` uint8 grid values of :func:`pack`'s storage.

    >>> unpack(pack(jnp.array([[3, 15], [9, 0], [7, 1]]), 4), 3, 4).tolist()
    [[3, 15], [9, 0], [7, 1]]
    """
    if bits != 4:
        return stored
    low = stored & np.uint8(0x0F)
    high = jax.lax.shift_right_logical(stored, np.uint8(4))
    both = jnp.stack([low, high], axis=1).reshape((2 * stored.shape[0],) + stored.shape[1:])
    return both[:n]


def _per_input(values: jax.Array, k: int, group_size: int) -> jax.Array:
    """Each group's value of ``values`` ``(N, G)`` repeated over its inputs: ``(N, k)``, by a
    broadcast and a reshape (and a slice for a last group that is cut short)."""
    n, groups = values.shape
    size = k if group_size == PER_CHANNEL else group_size
    full = jnp.broadcast_to(values[:, :, None], (n, groups, size)).reshape(n, groups * size)
    return full if groups * size == k else full[:, :k]


def dequantize(weights: dict, layout: tuple, dtype: Any) -> jax.Array:
    """The float ``(K, N)`` kernel that ``weights`` (see the module docstring) stand for.

    ``layout``: ``(bits, group_size)`` gathers the scales and zero points by ``g_idx``;
    ``(bits, group_size, True)`` (:func:`calibrated_layout` of natural order) repeats them over
    each group's inputs instead. The same values bit for bit.
    """
    bits, group_size = layout[:2]
    scale = weights["kernel_scale"].astype(jnp.float32)
    n = scale.shape[0]
    q = unpack(weights["kernel"], n, bits).astype(jnp.float32)  # (N, K)
    zero = weights["kernel_zero"].astype(jnp.float32)
    if layout[2:3] == (True,):
        k = q.shape[1]
        w_t = (q - _per_input(zero, k, group_size)) * _per_input(scale, k, group_size)
    else:
        groups = weights["g_idx"].astype(jnp.int32)
        w_t = (q - zero[:, groups]) * scale[:, groups]
    if weights.get("awq_scales") is not None:
        w_t = w_t / weights["awq_scales"].astype(jnp.float32)
    return w_t.T.astype(dtype)


def store(q: jax.Array, scale: jax.Array, zero: jax.Array, g_idx: Any, bits: int,
          scale_dtype: Any) -> dict[str, jax.Array]:
    """The layer attributes of a quantized ``(N, K)`` kernel: ``kernel``, ``kernel_scale``,
    ``kernel_zero``, ``g_idx``."""
    return {
        "kernel": pack(q, bits),
        "kernel_scale": jnp.asarray(scale).astype(scale_dtype),
        "kernel_zero": jnp.asarray(zero).astype(jnp.uint8),
        "g_idx": jnp.asarray(g_idx, jnp.float32),
    }


def placeholders(kernel_shape: Sequence[int], layout: tuple, scale_dtype: Any, awq: bool) -> dict[str, jax.Array]:
    """Zero arrays shaped like the calibrated form of a ``(K, N)`` kernel (what loading fills)."""
    bits, group_size = layout
    k, n = kernel_shape
    groups = group_count(k, group_size)
    rows = (n + 1) // 2 if bits == 4 else n
    out = {
        "kernel": jnp.zeros((rows, k), jnp.uint8),
        "kernel_scale": jnp.ones((n, groups), scale_dtype),
        "kernel_zero": jnp.zeros((n, groups), jnp.uint8),
        "g_idx": jnp.asarray(group_index(k, group_size)),
    }
    if awq:
        out["awq_scales"] = jnp.ones((k,), scale_dtype)
    return out


def layout_of(policy: Any) -> tuple[int, int]:
    """The static weight parameters of a GPTQ or AWQ policy: ``(weight_bits, group_size)``."""
    return (policy.weight_bits, policy.group_size)


def in_natural_order(g_idx: Any, group_size: int) -> bool:
    """Whether a concrete ``g_idx`` is :func:`group_index`: every input ``k`` in group
    ``k // group_size`` (False for GPTQ's act-order, and for a traced ``g_idx``, whose values are
    not known, or one that spans processes).

    >>> in_natural_order(group_index(5, 2), 2), in_natural_order(np.array([1., 0., 0., 1., 2.]), 2)
    (True, False)
    """
    if g_idx is None or isinstance(g_idx, jax.core.Tracer) or not getattr(g_idx, "is_fully_addressable", True):
        return False
    g_idx = np.asarray(g_idx)
    return g_idx.ndim == 1 and bool(np.array_equal(g_idx, group_index(g_idx.shape[0], group_size)))


def calibrated_layout(layout: tuple, g_idx: Any) -> tuple:
    """The kernels' layout for weights with ``g_idx``: ``layout`` ``(bits, group_size)`` and
    whether ``g_idx`` is in natural order (:func:`in_natural_order`), which lets the XLA path
    repeat the scales over each group instead of gathering them.

    >>> calibrated_layout((4, 2), group_index(5, 2)), calibrated_layout((4, 2), np.array([1., 0., 0., 1., 2.]))
    ((4, 2, True), (4, 2, False))
    """
    return tuple(layout[:2]) + (in_natural_order(g_idx, layout[1]),)


def is_calibrated(weights: dict) -> bool:
    return weights.get("kernel_scale") is not None


def uncalibrated_weights(kernel: jax.Array, contract_axes: Sequence[int], op: str, policy: Any,
                         scale_dtype: Any) -> dict[str, Any]:
    """The mode's quantizer before calibration: the float kernel stays, the state is empty."""
    del contract_axes, op, scale_dtype
    if kernel.ndim < 2:
        raise ValueError(f"{policy.quantization_mode} quantizes kernels of 2 or more axes (Dense, EinsumDense). "
                         f"Received shape {kernel.shape}")
    state = {"kernel_scale": None, "kernel_zero": None, "g_idx": None}
    if policy.quantization_mode == "awq":
        state["awq_scales"] = None
    return state


def einsum_kernel(equation: str, x: jax.Array, weights: dict, layout: tuple, compute_dtype: Any,
                  kernel: str | None = None) -> jax.Array:
    """The modes' einsum op; ``kernel`` names the kernel: ``"xla"`` (or None), the dequantized
    kernel in the compute dtype, then a float product; ``"cpu_ffi"``, autopolicy's CPU kernel
    (:mod:`autopolicy.numerics.cpu_weight_only`), ``"cpu_ffi_avx2"`` the same on its AVX2 path;
    ``"pallas"``, the Pallas kernel for GPUs (:mod:`autopolicy.numerics.pallas_weight_only`).
    ``layout``: ``(bits, group_size)``, or :func:`calibrated_layout`'s, whose group order lets
    the XLA path do without a gather.

    Raises:
      UncalibratedError: if the weights were never calibrated.
      ValueError: for an unknown kernel.
    """
    if kernel == "pallas":
        from autopolicy.numerics import pallas_weight_only  # it builds on this module

        # The kernels below read (bits, group_size); the order matters to the XLA path alone.
        return pallas_weight_only.einsum_kernel(equation, x, weights, layout[:2], compute_dtype, kernel)
    if kernel in cpu_kernels.FFI_KERNELS:
        from autopolicy.numerics import cpu_weight_only  # it builds on this module

        if cpu_weight_only.AVAILABLE and is_calibrated(weights):  # else it raises, naming why
            # On a CPU the kernel's call, elsewhere the XLA path below: the same values.
            return cpu_kernels.on_cpu(
                lambda x_, w_: cpu_weight_only.einsum_kernel(equation, x_, w_, layout[:2], compute_dtype, kernel),
                lambda x_, w_: einsum_kernel(equation, x_, w_, layout, compute_dtype), x, weights)
        return cpu_weight_only.einsum_kernel(equation, x, weights, layout[:2], compute_dtype, kernel)
    if kernel not in (None, "xla"):
        raise ValueError(f"Invalid GPTQ/AWQ kernel. Expected one of {('xla', *cpu_kernels.FFI_KERNELS, 'pallas')}. "
                         f"Received: kernel={kernel!r}")
    if not is_calibrated(weights):
        raise UncalibratedError("A GPTQ/AWQ layer runs only once calibrated: call "
                                "autopolicy.nn.calibrate_weights(model, batches) first.")
    w = dequantize(weights, layout, compute_dtype)
    return jnp.einsum(equation, x, w).astype(compute_dtype)


def no_gradient(weights: dict) -> dict:
    """The cotangent of stored weight-only weights in a kernel's custom VJP: zeros for float
    leaves, ``float0`` for integer ones (the quantized weights are not trained)."""
    def leaf(x: jax.Array) -> Any:
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.zeros_like(x)
        return np.zeros(x.shape, jax.dtypes.float0)

    return jax.tree_util.tree_map(leaf, weights)

