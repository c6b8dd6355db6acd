"""Sharding-aware contractions: the ``out_sharding`` an einsum needs under Explicit mesh axes.

Under a mesh whose axes are ``AxisType.Explicit`` (the default of ``jax.make_mesh``), a
contraction whose contracting dimension is sharded on both operands (a row-parallel layer:
``x`` sharded on its features, the kernel on its rows) is ambiguous to JAX, which asks for the
output's sharding. Every contraction a layer runs (float, int8, int4, float8, dequantized)
passes :func:`out_sharding` of its operands: the output keeps the batch axes' sharding of ``x``
and the output axes' sharding of the kernel, the contracted mesh axes reduced away (XLA inserts
the all-reduce, which the layer's timing then includes). Outside an Explicit mesh, or when no
contracting dimension is sharded, it is None and JAX decides as always.

>>> import jax.numpy as jnp
>>> out_sharding("mk,kn->mn", jnp.ones((2, 3)), jnp.ones((3, 4))) is None  # no mesh
True
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import AxisType, PartitionSpec

__all__ = ["out_sharding", "gather_out_sharding", "take_rows", "reshape", "explicit_mesh", "spec_of", "spans_devices", "describe", "collectives", "shards_along",
           "COLLECTIVES"]


def explicit_mesh() -> Any:
    """The abstract mesh in context when it has an Explicit axis, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    return mesh if any(t == AxisType.Explicit for t in mesh.axis_types) else None


def spec_of(x: Any) -> tuple:
    """``x``'s PartitionSpec as a tuple padded to its rank (() entries: not sharded)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec + (None,) * (jax.numpy.ndim(x) - len(spec))


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _letters(subscripts: str, rank: int) -> list[str]:
    """One symbol per dimension: the ``...`` expanded to numbered placeholders."""
    if "..." not in subscripts:
        return list(subscripts)
    head, tail = subscripts.split("...")
    middle = rank - len(head) - len(tail)
    return list(head) + [f"#{i}" for i in range(middle)] + list(tail)


def out_sharding(equation: str, x: Any, kernel: Any) -> PartitionSpec | None:
    """The ``out_sharding`` for ``einsum(equation, x, kernel)``: None outside an Explicit mesh
    or when no contracting dimension is sharded (JAX infers it), else the output's spec.

    A mesh axis that would shard two output dimensions shards only the first (from ``x``).
    """
    if explicit_mesh() is None:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    x_sub, k_sub = inputs.split(",")
    x_letters, k_letters = _letters(x_sub, jax.numpy.ndim(x)), _letters(k_sub, jax.numpy.ndim(kernel))
    specs = dict(zip(k_letters, spec_of(kernel)))
    specs.update({letter: entry for letter, entry in zip(x_letters, spec_of(x)) if entry is not None or
                  letter not in specs})
    ellipsis = sum(1 for letter in x_letters if letter.startswith("#"))
    out_letters = _letters(output, len(output.replace("...", "")) + ellipsis)  # the output's ... is x's
    contracted = (set(x_letters) & set(k_letters)) - set(out_letters)
    if not any(_axes(specs.get(letter)) for letter in contracted):
        return None
    used: set[str] = set()
    out = []
    for letter in out_letters:
        axes = tuple(a for a in _axes(specs.get(letter)) if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def gather_out_sharding(table: Any, ids: Any) -> PartitionSpec | None:
    """The ``out_sharding`` of ``table[ids]`` (rows of ``table``): None outside an Explicit mesh
    or when the ids are not sharded, else the ids' spec followed by the table's other axes'."""
    if explicit_mesh() is None:
        return None
    ids_spec = spec_of(ids)
    if not any(_axes(entry) for entry in ids_spec):
        return None
    used = {a for entry in ids_spec for a in _axes(entry)}
    rest = [entry if not set(_axes(entry)) & used else None for entry in spec_of(table)[1:]]
    return PartitionSpec(*ids_spec, *rest)


def take_rows(table: Any, ids: Any) -> Any:
    """``table[ids]``; under Explicit mesh axes with sharded ids, the rows come out sharded as
    the ids are (:func:`gather_out_sharding`), as JAX asks to be told."""
    spec = gather_out_sharding(table, ids)
    return table[ids] if spec is None else table.at[ids].get(out_sharding=spec)


def reshape(x: Any, shape: tuple) -> Any:
    """``x.reshape(shape)``; under Explicit mesh axes, a leading axis sharded before is sharded
    after (on the first new axis, which JAX cannot infer when a sharded axis is split), the rest
    unsharded: how quantized kernels flatten ``(batch, ..., features)`` to rows and back."""
    spec = spec_of(x) if explicit_mesh() is not None else ()
    if not spec or not _axes(spec[0]) or any(_axes(e) for e in spec[1:]) or not shape:
        return x.reshape(shape)
    shape = tuple(shape)
    if -1 in shape:  # resolved here: lax.reshape takes no -1
        known = math.prod(d for d in shape if d != -1)
        shape = tuple(math.prod(jax.numpy.shape(x)) // known if d == -1 else d for d in shape)
    return jax.lax.reshape(x, shape, out_sharding=PartitionSpec(spec[0], *([None] * (len(shape) - 1))))


def spans_devices(tree: Any) -> bool:
    """Whether any concrete array of ``tree`` is laid out over more than one device."""
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and len(getattr(sharding, "device_set", ())) > 1:
            return True
    return False


def describe(x: Any) -> str | None:
    """A concrete array's layout when it spans devices: the mesh's axes, their sizes and types,
    and its PartitionSpec (``"data=2,model=2 Explicit,Explicit P('data', None)"``); None for an
    array on one device. Part of a layer's signature, so sharded and unsharded layers (and two
    shardings) never share a timing."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or len(getattr(sharding, "device_set", ())) <= 1:
        return None
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None:
        return f"{type(sharding).__name__} over {len(sharding.device_set)} devices"
    axes = ",".join(f"{name}={size}" for name, size in mesh.shape.items())
    types = ",".join(str(t).split(".")[-1] for t in mesh.axis_types)
    return f"{axes} {types} {spec}"


#: The collective operations of XLA's HLO, as they appear in a compiled module's text.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast")


def collectives(hlo_text: str) -> str:
    """The collectives a compiled program runs, counted: ``"all-reduce x2, all-gather x1"``, or
    ``"none"``.

    >>> collectives("%a = f32[4] all-reduce(%x)\\n%b = f32[8] all-gather-start(%y)\\n%c = add(%a, %a)")
    'all-reduce x1, all-gather x1'
    """
    import re  # pylint: disable=import-outside-toplevel

    counts = {}
    for name in COLLECTIVES:
        # An op is "name(" or its async "name-start(" (its "-done" is the same op).
        found = len(re.findall(rf"\s{re.escape(name)}(?:-start)?\(", hlo_text))
        if found:
            counts[name] = found
    return ", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"


def shards_along(x: Any, axis: int) -> int:
    """How many pieces ``x`` is split into along ``axis`` (1: not split), from a concrete
    array's NamedSharding or, inside a trace, its Explicit sharding type."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or not hasattr(sharding, "spec"):
        sharding = getattr(jax.typeof(x), "sharding", None)
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None or axis >= len(spec):
        return 1
    pieces = 1
    for name in _axes(spec[axis]):
        pieces *= dict(mesh.shape)[name]
    return pieces
