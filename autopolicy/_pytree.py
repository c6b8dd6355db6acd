"""Frozen dataclasses that are JAX pytrees: array fields are leaves, ``static`` fields are not.

One generic registration serves every such class, so no class writes its own ``tree_flatten``
(and none can forget a field in it: every dataclass field is either a leaf or static).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax

T = TypeVar("T")


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is configuration (part of the treedef), not a pytree leaf."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def pytree_dataclass(cls: type[T]) -> type[T]:
    """Makes ``cls`` a frozen dataclass (with its own ``__init__``) and registers it as a pytree.

    Unflattening bypasses ``__init__``, so constructors may have any signature and validation
    runs once, at construction.
    """
    cls = dataclasses.dataclass(frozen=True, init=False, eq=False)(cls)
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get("static"))
    meta = tuple(f.name for f in fields if f.metadata.get("static"))

    def flatten_with_keys(obj):
        children = tuple((jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in data)
        return children, tuple(getattr(obj, n) for n in meta)

    def unflatten(aux, children):
        obj = object.__new__(cls)
        for name, value in zip(meta, aux):
            object.__setattr__(obj, name, value)
        for name, value in zip(data, children):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten)
    return cls


def replace(obj: T, **changes: Any) -> T:
    """A copy of a :func:`pytree_dataclass` instance with some fields changed (no ``__init__``)."""
    new = object.__new__(type(obj))
    for f in dataclasses.fields(obj):
        object.__setattr__(new, f.name, changes.pop(f.name, getattr(obj, f.name)))
    if changes:
        raise TypeError(f"{type(obj).__name__} has no fields {sorted(changes)}")
    return new


def set_fields(obj: Any, **values: Any) -> None:
    """Sets fields of a frozen dataclass from inside its ``__init__``."""
    for name, value in values.items():
        object.__setattr__(obj, name, value)
