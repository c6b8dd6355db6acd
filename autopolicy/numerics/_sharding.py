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

from typing import Any

import jax
from jax.sharding import AxisType, PartitionSpec

__all__ = ["out_sharding", "explicit_mesh", "spec_of"]


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
