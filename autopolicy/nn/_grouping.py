"""Layers that read one input, called together: a decoder's query, key and value projections (and
its gate and up) as one call of the CPU kernels where their policies and kernels agree.

:func:`call_on_shared_input` returns ``[layer(x) for layer in layers]``, and computes the
products of the layers that hold the same quantized form (int8, or int4 with the same blocks) and
run the same FFI kernel in one call (:mod:`autopolicy.numerics.grouped`), the same values bit for
bit. Each layer keeps its own policy: a tuned map that gives the query int8 and the key and value
int4 groups the key and value alone. Layers are called one by one where anything observes them
one by one: a hook (the search's probes, calibration), a parent compiled by parts, a parent still
building; and with several devices, or ``AUTOPOLICY_GROUPED_PROJECTIONS=0`` (read when a call is
traced: :func:`autopolicy.numerics.grouped.enabled`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax.numpy as jnp

from autopolicy.nn import _context, activations
from autopolicy.nn._quantizable import QuantizableKernel
from autopolicy.numerics import _sharding, grouped, modes

__all__ = ["call_on_shared_input", "group_keys"]


def _contracted(layer: QuantizableKernel, ndim: int) -> int | None:
    """How many trailing axes of an input of rank ``ndim`` the layer's product sums over, where it
    is one plain matrix product of those axes (the leading axes of its kernel, in the same order,
    the output being the input's other axes, then the kernel's): None otherwise."""
    if type(layer).__name__ == "Dense":
        return 1 if ndim >= 1 else None
    if type(layer).__name__ != "EinsumDense":
        return None
    try:
        equation = layer._full_equation(ndim)  # pylint: disable=protected-access
        summed, free = layer._product_letters()  # pylint: disable=protected-access
    except ValueError:
        return None
    lhs, rest = equation.split(",")
    kernel, out = rest.split("->")
    free_x = lhs[: len(lhs) - len(summed)]
    plain = (lhs.endswith(summed) and kernel == summed + free and out == free_x + free
             and len(set(lhs)) == len(lhs) and not set(free_x) & set(kernel))
    return len(summed) if plain and summed else None


def _key(layer: Any, x: Any) -> tuple | None:
    """What layers must share to run in one call (None: this layer cannot join one)."""
    if not isinstance(layer, QuantizableKernel) or not layer.__dict__.get("_own_built") or layer.kernel_op != "einsum":
        return None
    mode, kernel = layer._weights_mode, layer.__dict__.get("quantization_kernel")  # pylint: disable=protected-access
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        return None
    dtype = jnp.dtype(layer.dtype_policy.compute_dtype) if layer.autocast else jnp.dtype(x.dtype)
    if not grouped.can_group(mode, kernel, dtype):
        return None
    contracted = _contracted(layer, x.ndim)
    if contracted is None:
        return None
    return (mode, layer._weights_layout, kernel, dtype.name, contracted)  # pylint: disable=protected-access


def group_keys(layers: Sequence[Any], x: Any) -> list[tuple | None]:
    """Per layer, the key of the call it would share on input ``x`` (None: called on its own)."""
    return [_key(layer, x) for layer in layers]


def _observed() -> bool:
    """Whether the layers' own calls are observed (or the caller is building or compiled by parts)."""
    if _context.hooks():
        return True
    parent = _context.caller()
    return parent is not None and (parent.compiles_by_parts or not parent.__dict__.get("_frozen", True))


def call_on_shared_input(layers: Sequence[Any], x: Any) -> list[Any]:
    """``[layer(x) for layer in layers]``, the layers whose products can share one call of the CPU
    kernels (two or more of one key, :func:`group_keys`) computed in one."""
    if not grouped.enabled() or len(layers) < 2 or _observed():
        return [layer(x) for layer in layers]
    keys = group_keys(layers, x)
    members: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        if key is not None:
            members.setdefault(key, []).append(i)
    outputs: list[Any] = [None] * len(layers)
    for key, indexes in members.items():
        if len(indexes) < 2:
            continue
        for i, y in zip(indexes, _run_group(key, [layers[i] for i in indexes], x)):
            outputs[i] = y
    return [layer(x) if y is None else y for layer, y in zip(layers, outputs)]


def _run_group(key: tuple, layers: list, x: Any) -> list[Any]:
    mode, layout, kernel, _, contracted = key
    for layer in layers:
        layer._check_x64()  # pylint: disable=protected-access
    (xs,), _ = layers[0]._autocast_inputs((x,), {})  # pylint: disable=protected-access
    free_shape = xs.shape[: xs.ndim - contracted]
    x2 = _sharding.reshape(xs, (-1, math.prod(xs.shape[xs.ndim - contracted:])))
    state = ("kernel",) + modes.numerics_of(mode).state
    views = [layer._compute_view() for layer in layers]  # pylint: disable=protected-access
    forms = [grouped.matrix_weights(mode, {name: getattr(view, name) for name in state}, contracted) for view in views]
    ys = grouped.grouped_products(mode, layout, xs.dtype, kernel, x2, [mats for mats, _ in forms])
    outputs = []
    for view, (_, out_shape), y2 in zip(views, forms, ys):
        y = _sharding.reshape(y2, free_shape + out_shape)
        if view.bias is not None:
            y = y + view.bias
        outputs.append(activations.get(view.activation)(y))
    return outputs
