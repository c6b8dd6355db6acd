"""int4 quantization: weights packed two to a byte, scales per output channel or per block.

Weights: symmetric abs-max, as Keras 3.15 quantizes per channel (``value_range=(-8, 7)``, scale
``amax / 7``, so the values land in [-7, 7] and -8 stays unused). Keras's per-block form adds a
zero point (asymmetric); this one stays symmetric, so the integer product needs no zero-point
term. A kernel is first laid out as ``(K, *outputs)``, the contracted axes flattened into ``K``;
scales cover one output channel over all of ``K`` (per channel, ``block_size=-1``) or over
blocks of ``block_size`` consecutive entries of ``K`` (``G = ceil(K / block_size)`` scales per
output). Packing: byte row ``j`` holds rows ``2j`` and ``2j + 1`` in its low and high nibbles, as
Keras packs: consecutive rows, so a kernel sharded along ``K`` packs and unpacks on each shard
(saved models from before this layout, ``autopolicy.nn/1``, are repacked when loaded).

The product: unpack the nibbles to int8 and multiply them with the inputs quantized to int8 per
row, accumulating in int32 (on CPUs with VNNI or AMX through the u8 x s8 path of
:mod:`autopolicy.numerics._u8s8_dot`, as int8's default kernel does there; elsewhere XLA's
s8 x s8 dot), one accumulator per block, each rescaled by
its block's scale. The alternative, dequantizing the kernel to float and multiplying in float,
was measured slower: the dequantized kernel costs a float32 product plus the unpacking.
Medians of 7 rounds of 30 jitted calls, microseconds, on the 2-core AVX-512 VNNI CPU this was
written on (``x: (rows, K) @ (K, N)``, float32 inputs and output)::

    rows x K x N       float32   int8   int4 per channel   int4/128   dequantize, /-1   /128
    64 x 512 x 256        776     387        338               357           818         780
    128 x 1024 x 1024    6883    1332       1260              2288          6579        6078
    32 x 4096 x 4096    61514   15513      14583             13216         86716       88789
    1 x 1024 x 1024       326     167        267               404           796         887

So int4 runs at about int8's speed from a few dozen rows on; at one row (decoding a token)
unpacking dominates. Its gain is memory: 8x less than float32 per channel, 7.1x with blocks of
128 (whose scales and column sums add 1/16 byte per weight).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.numerics import _int8_accumulate, _sharding, _u8s8_dot, cpu_kernels
from autopolicy.numerics.int8 import INT8_MAX

__all__ = [
    "INT4_MIN",
    "INT4_MAX",
    "PER_CHANNEL",
    "block_count",
    "pack_int4",
    "unpack_int4",
    "quantize_int4",
    "dequantize_int4",
    "int4_matmul",
    "int4_einsum",
    "INT4_KERNELS",
    "int4_kernel_available",
    "default_int4_kernel",
    "block_size_of",
    "quantize_weights",
    "einsum_kernel",
]

INT4_MIN, INT4_MAX = -8, 7
#: The block size that means one scale per output channel (Keras's ``int4/-1``).
PER_CHANNEL = -1
_FOUR = np.int8(4)


def block_count(k: int, block_size: int) -> int:
    """How many scales each output has over a contraction of ``k``.

    >>> block_count(300, 128), block_count(300, PER_CHANNEL)
    (3, 1)
    """
    return 1 if block_size == PER_CHANNEL else math.ceil(k / block_size)


@jax.jit
def pack_int4(q: jax.Array) -> jax.Array:
    """Packs int8 values in [-8, 7] two to a byte along axis 0: ``(K, ...) -> (ceil(K/2), ...)``
    uint8, rows ``2j`` and ``2j + 1`` in byte row ``j``'s low and high nibbles (Keras's layout;
    odd ``K``: the last high nibble is 0). Consecutive rows, so a kernel sharded along ``K``
    packs and unpacks shard by shard, without a collective.

    >>> pack_int4(jnp.array([[-3], [7], [2]], jnp.int8))  # (-3 & 15) | (7 << 4), 2 | (0 << 4)
    Array([[125],
           [  2]], dtype=uint8)
    """
    k = q.shape[0]
    pairs = (k + 1) // 2
    padded = jnp.pad(q, [(0, 2 * pairs - k)] + [(0, 0)] * (q.ndim - 1))
    bits = jax.lax.bitcast_convert_type(padded, jnp.uint8).reshape((pairs, 2) + q.shape[1:])
    return (bits[:, 0] & np.uint8(0x0F)) | jax.lax.shift_left(bits[:, 1], np.uint8(4))


def _low(packed: jax.Array) -> jax.Array:
    signed = jax.lax.bitcast_convert_type(packed, jnp.int8)
    return jax.lax.shift_right_arithmetic(jax.lax.shift_left(signed, _FOUR), _FOUR)


def _high(packed: jax.Array) -> jax.Array:
    return jax.lax.shift_right_arithmetic(jax.lax.bitcast_convert_type(packed, jnp.int8), _FOUR)


def _unpack(packed: jax.Array, k: int) -> jax.Array:
    pairs = packed.shape[0]
    both = jnp.stack([_low(packed), _high(packed)], axis=1)  # (pairs, 2, ...)
    q = both.reshape((2 * pairs,) + packed.shape[1:])
    return q if 2 * pairs == k else q[:k]


@functools.partial(jax.jit, static_argnums=1)
def unpack_int4(packed: jax.Array, k: int) -> jax.Array:
    """The int8 values :func:`pack_int4` packed: ``(ceil(k/2), ...) -> (k, ...)``.

    >>> unpack_int4(jnp.array([[125], [2]], jnp.uint8), 3)[:, 0]
    Array([-3,  7,  2], dtype=int8)
    """
    return _unpack(packed, k)


def repack_split_halves(packed: np.ndarray, k: int) -> np.ndarray:
    """Converts int4 weights packed the way autopolicy did before format ``autopolicy.nn/2``
    (byte row ``i``: row ``i`` low, row ``i + ceil(k/2)`` high) to :func:`pack_int4`'s layout.

    >>> old = np.array([[45], [7]], np.uint8)  # rows (-3, 7, 2) in the old layout
    >>> repack_split_halves(old, 3)[:, 0]
    array([125,   2], dtype=uint8)
    """
    packed = np.asarray(packed, np.uint8)
    signed = packed.view(np.int8)
    low = ((signed << 4).astype(np.int8) >> 4).astype(np.int8)
    high = (signed >> 4).astype(np.int8)
    q = np.concatenate([low, high])[:k]
    return np.asarray(pack_int4(jnp.asarray(q)))


@functools.partial(jax.jit, static_argnums=(1, 2))
def quantize_int4(w: jax.Array, block_size: int, scale_dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Symmetric int4 quantization of ``w: (K, ...)`` with one scale per output and block of
    ``block_size`` rows (``PER_CHANNEL``: all ``K`` rows).

    Returns:
      ``(q, scale)``: ``q`` int8 in [-7, 7] shaped like ``w``; ``scale`` ``(G, ...)`` with
      ``w ~= q * scale`` repeated over each block's rows.

    >>> q, s = quantize_int4(jnp.array([[0.7], [-1.4], [0.1], [0.2]]), 2)
    >>> q[:, 0], s[:, 0]
    (Array([ 4, -7,  3,  7], dtype=int8), Array([0.2       , 0.02857143], dtype=float32))
    """
    k = w.shape[0]
    block = k if block_size == PER_CHANNEL else block_size
    groups = block_count(k, block_size)
    wf = jnp.pad(w.astype(jnp.float32), [(0, groups * block - k)] + [(0, 0)] * (w.ndim - 1))
    wf = wf.reshape((groups, block) + w.shape[1:])
    amax = jnp.max(jnp.abs(wf), axis=1, keepdims=True)
    # An all-zero block gets scale 1 (its values quantize to 0 either way).
    scale = jnp.where(amax > 0, amax / INT4_MAX, 1.0)
    q = jnp.clip(jnp.round(wf * (1.0 / scale)), INT4_MIN, INT4_MAX).astype(jnp.int8)
    return q.reshape((groups * block,) + w.shape[1:])[:k], jnp.squeeze(scale, 1).astype(scale_dtype)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def dequantize_int4(packed: jax.Array, scale: jax.Array, k: int, block_size: int, dtype: Any) -> jax.Array:
    """The ``(k, ...)`` kernel that ``packed`` and ``scale`` stand for, in ``dtype``."""
    q = unpack_int4(packed, k).astype(jnp.float32)
    block = k if block_size == PER_CHANNEL else block_size
    per_row = jnp.repeat(scale.astype(jnp.float32), block, axis=0, total_repeat_length=scale.shape[0] * block)
    return (q * per_row[:k]).astype(dtype)


@functools.partial(jax.jit, static_argnums=1)
def _column_sums(q: jax.Array, block_size: int) -> jax.Array:
    """``128 * sum(q)`` per block of rows, in int32 (what the +128 shift of u8 inputs adds)."""
    k = q.shape[0]
    block = k if block_size == PER_CHANNEL else block_size
    groups = block_count(k, block_size)
    padded = jnp.pad(q.astype(jnp.int32), [(0, groups * block - k)] + [(0, 0)] * (q.ndim - 1))
    return 128 * jnp.sum(padded.reshape((groups, block) + q.shape[1:]), axis=1)


#: The int4 kernels: ``"xla"`` (XLA's int8 dot of the unpacked kernel, the blocks as a batch) and ``"cpu_ffi"`` (autopolicy's CPU kernel, :mod:`autopolicy.numerics.cpu_kernels`:
#: the nibbles unpacked in registers, the blocks' scales applied inside; equal to ``"xla"`` up
#: to float32 rounding of the sum over blocks), on the CPU's best SIMD path, and ``"cpu_ffi_avx2"``,
#: the same library on its AVX2 path (a tactic of its own where the best path is another).
INT4_KERNELS = ("xla", "cpu_ffi", "cpu_ffi_avx2")


def int4_kernel_available(kernel: str, device: Any) -> bool:
    """Whether the int4 ``kernel`` is worth timing on ``device``."""
    if kernel not in INT4_KERNELS:
        raise ValueError(f"Invalid int4 kernel. Expected one of {INT4_KERNELS}. Received: kernel={kernel!r}")
    return kernel == "xla" or (_int8_accumulate.ffi_available(device)
                                and cpu_kernels.kernel_distinct_on(kernel, device.cpu_features))


def default_int4_kernel(device: Any = None) -> str:
    """``"xla"``: the FFI kernel runs only where a measurement chose it."""
    del device
    return "xla"


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _int4_matmul(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    colsum: jax.Array,
    block_size: int,
    compute_dtype: Any,
    kernel: str = "xla",
) -> jax.Array:
    """``x @ kernel`` for ``x: (M, K)`` and a packed int4 kernel ``(ceil(K/2), N)``.

    ``x`` is quantized to int8 per row; each block's int32 accumulator is rescaled by its scale
    ``(G, N)``; ``colsum`` ``(G, N)`` is ``128 * sum`` of each block's int4 values. Inputs get a
    straight-through gradient: the gradient of the product with the dequantized kernel.
    """
    return _int4_matmul_fwd(x, packed, scale, colsum, block_size, compute_dtype, kernel)[0]


# Jitted once per shape, block size and dtype: called outside a trace, its ops would otherwise
# run (and compile) one by one.
int4_matmul = jax.jit(_int4_matmul, static_argnums=(4, 5, 6))


def _int4_matmul_fwd(x, packed, scale, colsum, block_size, compute_dtype, kernel="xla"):
    if kernel in cpu_kernels.FFI_KERNELS:  # on a CPU the kernel's call, elsewhere XLA's path: the same values
        def run(on):
            return lambda *a: _int4_product(*a, block_size, compute_dtype, on)
        y = cpu_kernels.on_cpu(run(kernel), run("xla"), x, packed, scale, colsum)
        return y, (x, packed, scale, colsum)
    return _int4_product(x, packed, scale, colsum, block_size, compute_dtype, kernel), (x, packed, scale, colsum)


def _int4_product(x, packed, scale, colsum, block_size, compute_dtype, kernel):
    rows, k = x.shape
    dtypes = cpu_kernels.DENSE_DTYPES
    ffi = kernel in cpu_kernels.FFI_KERNELS
    if ffi and jnp.dtype(x.dtype).name in dtypes and jnp.dtype(compute_dtype).name in dtypes:
        # One call quantizes x, multiplies and rescales: the values of the unfused path below.
        block = k if block_size == PER_CHANNEL else block_size
        return cpu_kernels.int4_dense(x, packed, scale.astype(jnp.float32), block, out_dtype=compute_dtype,
                                      simd_path=cpu_kernels.kernel_path(kernel))
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    xq = jnp.clip(jnp.round(xf * (1.0 / x_scale)), -INT8_MAX, INT8_MAX)
    if ffi:
        block = k if block_size == PER_CHANNEL else block_size
        y = cpu_kernels.int4_matmul(xq.astype(jnp.int8), packed, scale.astype(jnp.float32), block,
                                    cpu_kernels.kernel_path(kernel))
        return (y * x_scale).astype(compute_dtype)
    # The u8 x s8 dot only where it is fast (VNNI/AMX), as int8's default kernel, and on one
    # device: its blocks slice the column sums and the custom dot does not propagate shardings
    # (on a mesh it failed on a K-sharded kernel and added all-gathers), so several devices take
    # the sharding-aware s8 x s8 path, as the FFI kernels do.
    u8 = (jax.default_backend() == "cpu" and jax.device_count() == 1
          and _int8_accumulate.default_int8_kernel() == "u8s8")
    if u8:
        xin = (xq + 128.0).astype(jnp.uint8)
        if rows == 1:  # YNNPACK's kernel needs two rows; a copy costs less than the slow path.
            xin = jnp.concatenate([xin, xin])
        dot = _u8s8_dot.u8s8_matmul
    else:
        # Off a CPU the accumulators come from a float32 dot (HIGHEST): on an H200 (jax 0.11.2)
        # XLA:GPU's Triton int8 GEMMs gave wrong int4 products, a block of 2 rows (K = 50 in blocks
        # of 16) wrong in a quarter of its accumulators and, with K = 48 in blocks of 16, whole
        # outputs twice the CPU's (a diagnostic against numpy's int64 sums; right with
        # --xla_gpu_enable_triton_gemm=false). Each product is at most 127 * 8 in size, so the
        # float32 sums are exact for blocks of up to 16512 rows.
        xin = xq.astype(jnp.int8)
        dot = functools.partial(_int8_accumulate.integer_on_cpu, "mk,kn->mn")
    q = _unpack(packed, k)  # (K, N) int8: consecutive rows, so a K-sharded kernel unpacks in place
    block = k if block_size == PER_CHANNEL else block_size
    groups = block_count(k, block_size)
    if not u8 and groups > 1 and groups * block == k:
        # Every block's accumulators in one batched int8 dot, (G, M, N), then rescaled and summed.
        n = q.shape[1]
        xb, qb = xin.reshape((xin.shape[0], groups, block)), q.reshape((groups, block, n))
        acc = _int8_accumulate.integer_on_cpu("mgb,gbn->gmn", xb, qb)
        y = jnp.sum(acc.astype(jnp.float32) * scale.astype(jnp.float32)[:, None, :], axis=0)
        return (y * x_scale).astype(compute_dtype)
    y = None
    for g in range(groups):
        lo, hi = g * block, min(k, (g + 1) * block)
        acc = dot(xin[:, lo:hi], q[lo:hi]) if groups > 1 else dot(xin, q)
        if u8:
            acc = acc[:rows] - colsum[g]
        term = acc.astype(jnp.float32) * scale[g].astype(jnp.float32)
        y = term if y is None else y + term
    return (y * x_scale).astype(compute_dtype)


def _int4_matmul_bwd(block_size, compute_dtype, kernel, residuals, g):
    del compute_dtype, kernel  # every kernel has the same forward values (to rounding): one gradient
    x, packed, scale, colsum = residuals
    kernel = dequantize_int4(packed, scale, x.shape[1], block_size, x.dtype)
    dx = jnp.matmul(g.astype(x.dtype), kernel.T)
    # The packed kernel, its scales and column sums are not trained: no gradient flows to them.
    return (dx, np.zeros(packed.shape, jax.dtypes.float0), jnp.zeros_like(scale),
            np.zeros(colsum.shape, jax.dtypes.float0))


_int4_matmul.defvjp(_int4_matmul_fwd, _int4_matmul_bwd)


def _split_equation(equation: str) -> tuple[str, str, str]:
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    return lhs, rhs, out


def int4_einsum(
    equation: str,
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    colsum: jax.Array,
    block_size: int,
    compute_dtype: Any,
    kernel: str | None = None,
) -> jax.Array:
    """``einsum(equation, x, kernel)`` with the int4 kernel of :func:`quantize_weights`;
    ``kernel`` names the int4 kernel (:data:`INT4_KERNELS`; None: ``"xla"``).

    The kernel is stored as ``(K, *outputs)`` (its contracted axes, in the equation's kernel
    order, flattened into ``K``). An equation that is a matrix product once ``x`` is transposed
    runs :func:`int4_matmul`; any other (an axis shared by input, kernel and output, an axis
    summed in ``x`` alone) runs on the dequantized kernel.
    """
    lhs, rhs, out = _split_equation(equation)
    contracted = [c for c in rhs if c in lhs and c not in out]
    others = [c for c in rhs if c not in contracted]
    free_x = [c for c in lhs if c not in contracted]
    sizes = dict(zip(lhs, x.shape))
    k = math.prod(sizes[c] for c in contracted)
    plain = (
        "." not in equation
        and len(set(lhs)) == len(lhs)
        and len(set(rhs)) == len(rhs)
        and not set(free_x) & set(others)
        and sorted(free_x + others) == sorted(out)
    )
    if not plain:
        kernel = dequantize_int4(packed, scale, k, block_size, x.dtype)
        kernel = kernel.reshape(tuple(sizes[c] for c in contracted) + packed.shape[1:])
        kernel = jnp.transpose(kernel, [(contracted + others).index(c) for c in rhs])
        return jnp.einsum(equation, x, kernel, out_sharding=_sharding.out_sharding(equation, x, kernel)).astype(
            compute_dtype)
    order = [lhs.index(c) for c in free_x + contracted]
    x2 = _sharding.reshape(jnp.transpose(x, order), (-1, k))
    n = math.prod(packed.shape[1:])
    if kernel in cpu_kernels.FFI_KERNELS:
        if not cpu_kernels.AVAILABLE:
            raise ValueError(f"The int4 kernel {kernel!r} is not available here: {cpu_kernels.unavailable_reason()}. "
                             "Use kernel='xla'.")
        cpu_kernels.kernel_path(kernel)  # a path this CPU cannot run raises here
    y2 = int4_matmul(x2, packed.reshape((packed.shape[0], n)), scale.reshape((scale.shape[0], n)),
                     colsum.reshape((colsum.shape[0], n)), block_size, compute_dtype, kernel or "xla")
    y = _sharding.reshape(y2, tuple(sizes[c] for c in free_x) + packed.shape[1:])
    return jnp.transpose(y, [(free_x + others).index(c) for c in out])


# --- the mode's entry points (autopolicy.numerics.modes) --------------------------------------


def block_size_of(policy: Any) -> tuple[int]:
    """The layout of a policy's int4 weights: ``(block_size,)``, ``PER_CHANNEL`` for
    ``int4_from_*`` and ``int4/-1_from_*``."""
    return (getattr(policy, "block_size", PER_CHANNEL),)


def quantize_weights(kernel: jax.Array, contract_axes: Sequence[int], op: str, policy: Any,
                     scale_dtype: Any) -> dict[str, jax.Array]:
    """The int4 form of a float kernel: ``kernel`` (packed uint8 ``(ceil(K/2), *outputs)``),
    ``kernel_scale`` ``(G, *outputs)`` and ``kernel_colsum`` ``(G, *outputs)`` int32."""
    del op  # int4 runs einsum kernels only
    (block_size,) = block_size_of(policy)
    axes = tuple(sorted(a % kernel.ndim for a in contract_axes))
    _check_shards(kernel, axes, block_size)
    return _quantize_kernel(kernel, axes, block_size, jnp.dtype(scale_dtype))


def _check_shards(kernel: jax.Array, axes: tuple[int, ...], block_size: int) -> None:
    """A kernel sharded along its contraction keeps every block (and byte pair) on one shard:
    each shard's rows must be a whole number of blocks (per channel: of pairs)."""
    if len(axes) != 1:
        return
    pieces = _sharding.shards_along(kernel, axes[0])
    if pieces <= 1:
        return
    rows = kernel.shape[axes[0]]
    unit = 2 if block_size == PER_CHANNEL else block_size
    if rows % pieces or (rows // pieces) % unit:
        what = "pairs of rows (two int4 values a byte)" if block_size == PER_CHANNEL else f"blocks of {block_size} rows"
        raise ValueError(f"Cannot quantize a kernel sharded {pieces} ways along its {rows} contracted rows to int4 "
                         f"with block_size={block_size}: each shard's {rows / pieces:g} rows are not whole {what}, so "
                         "blocks would cross shard boundaries. Choose a block size that divides the rows of a shard "
                         "(or shard the kernel along its outputs).")


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_kernel(kernel, axes, block_size, scale_dtype):
    others = [a for a in range(kernel.ndim) if a not in axes]
    outputs = tuple(kernel.shape[a] for a in others)
    w = jnp.transpose(kernel, list(axes) + others).reshape((-1,) + outputs)
    q, scale = quantize_int4(w, block_size, scale_dtype)
    return {"kernel": pack_int4(q), "kernel_scale": scale, "kernel_colsum": _column_sums(q, block_size)}


def einsum_kernel(equation: str, x: jax.Array, weights: dict, layout: tuple, compute_dtype: Any,
                  kernel: str | None = None) -> jax.Array:
    """The mode's einsum op; ``kernel`` names the int4 kernel (None: ``"xla"``)."""
    (block_size,) = layout
    if kernel is not None and kernel not in INT4_KERNELS:
        raise ValueError(f"Invalid int4 kernel. Expected one of {INT4_KERNELS}. Received: kernel={kernel!r}")
    return int4_einsum(equation, x, weights["kernel"], weights["kernel_scale"], weights["kernel_colsum"],
                       block_size, compute_dtype, kernel)
