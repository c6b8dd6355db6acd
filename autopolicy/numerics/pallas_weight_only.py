"""The GPTQ and AWQ product as a Pallas kernel (kernel ``"pallas"`` of those modes, for GPUs).

The XLA path of :mod:`autopolicy.numerics.weight_only` dequantizes the whole kernel to the
compute dtype and then multiplies: every call writes and reads a float kernel 2-8x the size of
the stored bytes. This kernel reads the stored bytes once and dequantizes tile by tile in
registers: ``w = (q - zero) * scale``, float32, the very expression of
:func:`~autopolicy.numerics.weight_only.dequantize` (so its weights equal that function's bit
for bit), then a product with float32 accumulation. On GPUs it runs on Pallas's Triton backend;
elsewhere, ``interpret=True`` runs the same kernel code through Pallas's interpreter, which is
how the CPU test suite checks it (slowly: it is not a CPU kernel).

Tiling: a program per ``(block_m, block_n)`` tile of the output (rows of ``x`` by stored rows of
the weight), looping over ``K`` in steps of ``block_k``; all block sizes are powers of two of at
least 16, as the Triton backend's dots need (see :func:`block_sizes`). 4-bit values, packed two
a byte along the outputs, are unpacked per tile into two planes (even and odd outputs), each
multiplied on its own; their outputs are interleaved after the kernel. Tails: ``x`` (small) is
padded with zeros to whole tiles; the stored weight (large) is never copied: its loads are
masked past ``N`` and ``K``. Outputs are computed on whole tiles and sliced.

Groups: each weight's scale and zero point are gathered by its output row and its input's
entry of ``g_idx``, inside the kernel, so any ``g_idx`` is exact, GPTQ's act-order (inputs
assigned to groups out of order) included: no permutation of the weight, no fallback, no
check (``g_idx`` is an array, traced under ``jit``). Entries are clamped to the groups, as
XLA's indexing in the reference path does. AWQ's channel scales are folded into the inputs
(``x / awq_scales`` in float32, then the compute dtype), as autopolicy's CPU kernel does.

Accuracy: float32 compute multiplies in IEEE float32 (not TF32), within float32 rounding of the
exact product (the tests hold it to 1e-5 of the output's norm); bfloat16 and float16 compute
round the dequantized weights to the compute dtype as the XLA path does and accumulate in
float32 (the tests: 1e-2 of the output's norm). Fallbacks to the XLA path, chosen while
tracing: operands laid out over several devices, einsums that are not one product
``x[..., k] @ kernel[k, n]``, and compute dtypes other than :data:`COMPUTE_DTYPES`. Gradients
flow to the inputs through the XLA path (a custom VJP); the quantized weights get none.

>>> kernel_available(Device("gpu", compute_capability="9.0")), kernel_available(Device("cpu"))
(True, False)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from autopolicy.numerics import _sharding, weight_only
from autopolicy.numerics.device import Device

__all__ = ["KERNEL", "COMPUTE_DTYPES", "kernel_available", "block_sizes", "weight_only_matmul", "einsum_kernel"]

#: The kernel's name among the GPTQ and AWQ kernels (tactics).
KERNEL = "pallas"
#: Compute dtypes the kernel multiplies in; other dtypes take the XLA path.
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
#: The smallest block: Triton's dots need 16 rows, columns and depth.
_MIN_BLOCK = 16


def kernel_available(device: Device) -> bool:
    """Whether the Pallas kernel is worth timing on ``device``: on GPUs only (elsewhere it runs
    in Pallas's interpreter, correct but slow)."""
    return device.platform == "gpu"


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_sizes(rows: int, k: int) -> tuple[int, int, int]:
    """The default tile ``(block_m, block_n, block_k)`` for ``rows`` rows of ``x`` and ``k``
    inputs: ``block_m`` covers the rows (16 at decode, at most 64); ``block_n`` (stored weight
    rows a program, per plane) is 32 at 16 rows or fewer, so a decode step has twice the
    programs to fill a GPU's SMs, and 64 beyond; ``block_k`` is 128 (64 beyond 16 rows), less
    for a small ``k``. Group sizes do not constrain it: scales are gathered per input.

    >>> block_sizes(1, 4096), block_sizes(17, 200), block_sizes(300, 40)
    ((16, 32, 128), (32, 64, 64), (64, 64, 64))
    """
    block_m = min(64, max(_MIN_BLOCK, _next_power_of_two(rows)))
    block_n = 32 if rows <= _MIN_BLOCK else 64
    block_k = min(128 if rows <= _MIN_BLOCK else 64, max(_MIN_BLOCK, _next_power_of_two(k)))
    return block_m, block_n, block_k


def _plane(q: jax.Array, bits: int, plane: int) -> jax.Array:
    """The grid values of one plane of a stored tile: 8-bit, the bytes; 4-bit, the low nibbles
    (even outputs) or the high ones (odd outputs)."""
    if bits != 4:
        return q
    return q & np.uint8(0x0F) if plane == 0 else jax.lax.shift_right_logical(q, np.uint8(4))


def _dequantize_tile(values: jax.Array, out_rows: jax.Array, groups_of_k: jax.Array, scale_ref: Any,
                     zero_ref: Any, groups: int) -> jax.Array:
    """``(q - zero) * scale`` float32 of a ``(block_n, block_k)`` tile of grid values: scale and zero
    point gathered (from the flat ``(N * G,)`` arrays) at each weight's output row and group."""
    index = out_rows[:, None] * groups + groups_of_k[None, :]
    scale = scale_ref[index].astype(jnp.float32)
    zero = zero_ref[index].astype(jnp.float32)
    return (values.astype(jnp.float32) - zero) * scale


def _kernel(x_ref, q_ref, g_ref, scale_ref, zero_ref, *out_refs, bits: int, n: int, k: int, stored_rows: int,
            groups: int, block_k: int):
    """One ``(block_m, block_n)`` output tile per plane: over ``K`` in steps of ``block_k``, the
    stored tile is loaded (masked), unpacked, dequantized and multiplied into float32 sums."""
    block_n = q_ref.shape[0]
    row = pl.program_id(1) * block_n + jax.lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    # Each plane's output rows, clamped into N: rows past it (tails, odd N) are sliced off.
    out_rows = [jnp.minimum(row * len(out_refs) + p, n - 1) for p in range(len(out_refs))]
    row_ok = (row < stored_rows)[:, None]

    def step(i, accs):
        k0 = pl.multiple_of(i * block_k, block_k)
        col_ok = (k0 + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0) < k)[None, :]
        # Masked: the stored weight is not padded, its last tiles overhang it.
        q = plgpu.load(q_ref.at[:, pl.ds(k0, block_k)], mask=row_ok & col_ok, other=0)
        x = x_ref[:, pl.ds(k0, block_k)]
        g = g_ref[pl.ds(k0, block_k)]
        new = []
        for p, acc in enumerate(accs):
            w = _dequantize_tile(_plane(q, bits, p), out_rows[p], g, scale_ref, zero_ref, groups).astype(x.dtype)
            # HIGHEST: IEEE float32 products for float32 (Triton's default is TF32).
            new.append(acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                                 preferred_element_type=jnp.float32))
        return tuple(new)

    zeros = tuple(jnp.zeros(ref.shape, jnp.float32) for ref in out_refs)
    accs = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, zeros)
    for ref, acc in zip(out_refs, accs):
        ref[...] = acc


def _default_interpret() -> bool:
    """Interpret unless JAX's default device (``jax.default_device`` when set) is a GPU."""
    device = jax.config.jax_default_device
    platform = getattr(device, "platform", device) or jax.default_backend()
    return platform not in ("gpu", "cuda", "rocm")


def _check_blocks(blocks: Any) -> tuple[int, int, int]:
    if (not isinstance(blocks, tuple) or len(blocks) != 3
            or not all(isinstance(b, int) and b >= _MIN_BLOCK and b & (b - 1) == 0 for b in blocks)):
        raise ValueError("weight_only_matmul: blocks must be (block_m, block_n, block_k), powers of two of at least "
                         f"{_MIN_BLOCK}. Received: blocks={blocks!r}")
    return blocks


def _check_operands(x, q, scale, zero, g_idx, bits, group) -> None:
    if bits not in (4, 8):
        raise ValueError(f"Invalid bits. Expected one of (4, 8). Received: bits={bits!r}")
    if x.ndim != 2 or jnp.dtype(x.dtype).name not in COMPUTE_DTYPES:
        raise ValueError(f"weight_only_matmul: x must be a 2-D array of one of {COMPUTE_DTYPES}. "
                         f"Received: {x.dtype}{list(x.shape)}")
    k = x.shape[1]
    if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= max(k, 1):
        raise ValueError(f"weight_only_matmul: group must be an int in [1, {k}]. Received: group={group!r}")
    n, groups = scale.shape[0] if scale.ndim == 2 else -1, -(-k // group)
    expected = {"q": ((n + 1) // 2 if bits == 4 else n, k), "scale": (n, groups), "zero": (n, groups), "g_idx": (k,)}
    dtypes = {"q": "uint8", "scale": "a float dtype", "zero": "uint8", "g_idx": "a real dtype"}
    for name, array in (("scale", scale), ("q", q), ("zero", zero), ("g_idx", g_idx)):
        if array is None:  # g_idx: natural
            continue
        kind = jnp.dtype(array.dtype)
        ok = {"scale": jnp.issubdtype(kind, jnp.floating), "g_idx": not jnp.issubdtype(kind, jnp.complexfloating)
              }.get(name, kind == jnp.uint8)
        if tuple(array.shape) != expected[name] or not ok:
            raise ValueError(f"weight_only_matmul: {name} must be {list(expected[name])} of {dtypes[name]} (x is "
                             f"{list(x.shape)}, bits={bits}, group={group}). "
                             f"Received: {array.dtype}{list(array.shape)}")


def weight_only_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array, bits: int, group: int,
                       g_idx: jax.Array | None = None, *, blocks: tuple[int, int, int] | None = None,
                       interpret: bool | None = None) -> jax.Array:
    """``x @ W^T`` ``(M, N)`` float32 for ``W[n, k] = scale[n, g] * (q[n, k] - zero[n, g])``,
    ``g = g_idx[k]`` (by default ``k // group``), on the Pallas kernel.

    Args:
      x: ``(M, K)`` float32, bfloat16 or float16 (the dtype the weights are rounded to before
        the product; float32 accumulation either way).
      q: uint8 grid values: ``bits=4``, packed two a byte along the outputs, ``(ceil(N/2), K)``
        (:func:`autopolicy.numerics.weight_only.pack`); ``bits=8``, one a byte, ``(N, K)``.
      scale: ``(N, G)`` of a float dtype (applied in float32), ``G = ceil(K / group)``.
      zero: uint8 ``(N, G)``.
      bits: 4 (packed) or 8 (one value a byte: 2-, 3- and 8-bit weights).
      group: Inputs per group, in ``[1, K]``; sets ``G`` (and the default ``g_idx``).
      g_idx: ``(K,)``, each input's group (whole numbers, in any order; clamped into ``[0, G)``).
      blocks: ``(block_m, block_n, block_k)``, powers of two of at least 16; None:
        :func:`block_sizes`.
      interpret: Run in Pallas's interpreter; None: unless JAX's default device is a GPU.

    Raises:
      ValueError: naming the operand of the wrong rank, dtype or shape, a bad ``bits``,
        ``group`` or ``blocks``.

    >>> x = jnp.array([[1.0, 2.0]])
    >>> q = jnp.array([[3, 1], [0, 2]], jnp.uint8)  # N = 2 outputs, K = 2 inputs, 8-bit
    >>> scale, zero = jnp.array([[0.5], [2.0]]), jnp.array([[1], [0]], jnp.uint8)
    >>> weight_only_matmul(x, q, scale, zero, 8, 2, interpret=True).tolist()  # W = [[1, 0], [0, 4]]
    [[1.0, 8.0]]
    """
    _check_operands(x, q, scale, zero, g_idx, bits, group)
    g_idx = jnp.asarray(weight_only.group_index(x.shape[-1], group)) if g_idx is None else g_idx
    m, k = x.shape
    n, groups = scale.shape
    block_m, block_n, block_k = block_sizes(m, k) if blocks is None else _check_blocks(blocks)
    interpret = _default_interpret() if interpret is None else bool(interpret)
    planes, stored_rows = (2 if bits == 4 else 1), q.shape[0]
    mp, kp, rp = (-(-m // block_m) * block_m, -(-k // block_k) * block_k, -(-stored_rows // block_n) * block_n)
    # The small operands are padded on the host; the stored weight is read in place (masked).
    xp = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    gp = jnp.pad(jnp.clip(g_idx.astype(jnp.int32), 0, groups - 1), (0, kp - k), mode="edge")
    kernel = functools.partial(_kernel, bits=bits, n=n, k=k, stored_rows=stored_rows, groups=groups, block_k=block_k)
    whole = lambda size: pl.BlockSpec((size,), lambda i, j: (0,))  # noqa: E731  (every program: all of it)
    outs = pl.pallas_call(
        kernel,
        grid=(mp // block_m, rp // block_n),
        in_specs=[pl.BlockSpec((block_m, kp), lambda i, j: (i, 0)), pl.BlockSpec((block_n, k), lambda i, j: (j, 0)),
                  whole(kp), whole(n * groups), whole(n * groups)],
        out_specs=[pl.BlockSpec((block_m, block_n), lambda i, j: (i, j))] * planes,
        out_shape=[jax.ShapeDtypeStruct((mp, rp), jnp.float32)] * planes,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name=f"autopolicy_weight_only_{bits}bit",
    )(xp, q, gp, scale.reshape(-1), zero.reshape(-1))
    y = outs[0] if planes == 1 else jnp.stack(outs, axis=-1).reshape(mp, planes * rp)
    return y[:m, :n]


def _is_product(equation: str) -> bool:
    """Whether the einsum is ``x[..., k] @ kernel[k, n]`` as laid out (no transposes).

    >>> _is_product("mk,kn->mn"), _is_product("abc,cd->abd"), _is_product("mk,nk->mn")
    (True, True, False)
    """
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    return (len(rhs) == 2 and len(set(lhs + rhs[1])) == len(lhs) + 1 and lhs[-1:] == rhs[0]
            and out == lhs[:-1] + rhs[1])


def _sharded(tree: Any) -> bool:
    if _sharding.spans_devices(tree):
        return True
    if _sharding.explicit_mesh() is None:
        return False
    return any(any(e is not None for e in _sharding.spec_of(leaf)) for leaf in jax.tree_util.tree_leaves(tree))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _product(x2: jax.Array, weights: dict, layout: tuple, compute_dtype: Any, interpret: bool) -> jax.Array:
    """The kernel's product of rows ``x2`` ``(M, K)`` in the compute dtype (the gradient: the
    XLA path's)."""
    bits, group_size = layout
    k = x2.shape[1]
    x = x2.astype(jnp.float32)
    if weights.get("awq_scales") is not None:
        x = x / weights["awq_scales"].astype(jnp.float32)
    group = k if group_size == weight_only.PER_CHANNEL else min(group_size, k)
    y = weight_only_matmul(x.astype(compute_dtype), weights["kernel"], weights["kernel_scale"], weights["kernel_zero"],
                           4 if bits == 4 else 8, group, weights["g_idx"], interpret=interpret)
    return y.astype(compute_dtype)


def _product_fwd(x2, weights, layout, compute_dtype, interpret):
    return _product(x2, weights, layout, compute_dtype, interpret), (x2, weights)


def _product_bwd(layout, compute_dtype, interpret, residuals, g):
    del interpret
    x2, weights = residuals
    w = weight_only.dequantize(weights, layout, compute_dtype)
    _, vjp = jax.vjp(lambda x_: jnp.matmul(x_, w).astype(compute_dtype), x2)
    (dx,) = vjp(g)
    # The quantized weights are not trained: no gradient flows to them.
    return dx, weight_only.no_gradient(weights)


_product.defvjp(_product_fwd, _product_bwd)


def einsum_kernel(equation: str, x: jax.Array, weights: dict, layout: tuple, compute_dtype: Any,
                  kernel: str | None = KERNEL, *, interpret: bool | None = None) -> jax.Array:
    """The GPTQ/AWQ einsum op on the Pallas kernel (the XLA path where it does not apply: see
    the module docstring); the signature of
    :func:`autopolicy.numerics.weight_only.einsum_kernel`, which calls it for ``kernel="pallas"``.

    Args:
      equation: The layer's einsum, ``x`` first.
      x: The inputs.
      weights: The stored weights (:mod:`autopolicy.numerics.weight_only`).
      layout: ``(bits, group_size)``.
      compute_dtype: The dtype of the product and of the result.
      kernel: ``"pallas"``.
      interpret: Run in Pallas's interpreter; None: unless JAX's default device is a GPU.

    Raises:
      ValueError: for another kernel (the others run through
        :func:`autopolicy.numerics.weight_only.einsum_kernel`).
      autopolicy.numerics.weight_only.UncalibratedError: if the weights were never calibrated.
    """
    if kernel != KERNEL:
        raise ValueError(f"pallas_weight_only.einsum_kernel runs the kernel {KERNEL!r} only (the others run through "
                         f"weight_only.einsum_kernel). Received: kernel={kernel!r}")
    if not weight_only.is_calibrated(weights):
        return weight_only.einsum_kernel(equation, x, weights, layout, compute_dtype)  # raises, naming why
    eq = equation.replace(" ", "")
    dtype = jnp.dtype(compute_dtype)
    if dtype.name not in COMPUTE_DTYPES or not _is_product(eq) or _sharded((x, weights)):
        return weight_only.einsum_kernel(eq, x, weights, layout, compute_dtype)
    weights = {name: value for name, value in weights.items() if value is not None}
    interpret = _default_interpret() if interpret is None else bool(interpret)
    x2 = x.reshape((-1, x.shape[-1]))
    y2 = _product(x2, weights, tuple(layout), dtype, interpret)
    return y2.reshape(x.shape[:-1] + (y2.shape[-1],))
