"""What every part of the module system shares: how a module's attributes split into pytree
children and static configuration, and how a tree of modules is copied and rebuilt."""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import numpy as np

from autopolicy.nn._frozen_map import FrozenPolicyMap
from autopolicy.policies import DTypePolicy

__all__ = ["ModuleBase", "is_module", "is_array", "is_dynamic", "map_children"]

BOOKKEEPING = ("_frozen", "_child_names", "_aux")


class ModuleBase:
    """Marker base class, so helpers can recognise modules without importing ``Module``."""


def is_module(x: Any) -> bool:
    return isinstance(x, ModuleBase)


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def is_dynamic(value: Any) -> bool:
    """Arrays, modules and containers holding them are pytree children; the rest is static."""
    if is_array(value) or is_module(value):
        return True
    if value is None or isinstance(value, (str, int, float, bool, DTypePolicy, FrozenPolicyMap)):
        return False
    leaves = jax.tree_util.tree_leaves(value, is_leaf=is_module)
    return any(is_array(leaf) or is_module(leaf) for leaf in leaves)


def snake_case(name: str) -> str:
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()


def dedupe(base: str, used: set[str]) -> str:
    if base not in used:
        return base
    i = 1
    while f"{base}_{i}" in used:
        i += 1
    return f"{base}_{i}"


def map_children(module: Any, fn: Callable[[Any], Any]) -> None:
    """Replaces, in place, every child module ``m`` of a mutable ``module`` by ``fn(m)``."""
    for key, value in list(module._attrs()):
        if is_module(value) or (is_dynamic(value) and not is_array(value)):
            new = jax.tree_util.tree_map(lambda x: fn(x) if is_module(x) else x, value, is_leaf=is_module)
            object.__setattr__(module, key, new)


def mutable_tree(module: Any) -> Any:
    """A copy of the whole tree whose modules accept attribute assignments (for building)."""
    new = module._copy(mutable=True)
    map_children(new, mutable_tree)
    return new


def map_modules(module: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuilds the tree bottom-up, replacing each module by ``fn(copy)`` when not None."""
    new = module._copy(mutable=True)
    map_children(new, lambda child: map_modules(child, fn))
    new._freeze()
    replaced = fn(new)
    return new if replaced is None else replaced


def freeze_tree(module: Any) -> None:
    for child in module._child_items():
        freeze_tree(child[2])
    module._freeze()


# --- pytree registration (one generic flatten for every subclass) -----------------------------


class _Aux(tuple):
    """A module's pytree aux data, ``(child names, static attributes)``, hashed once: jit hashes
    and compares the aux data of every module at every call (a decoder has hundreds)."""

    def __hash__(self) -> int:
        cached = self.__dict__.get("hash")
        if cached is None:
            cached = self.__dict__["hash"] = tuple.__hash__(self)
        return cached


def _aux(module: Any) -> _Aux:
    """The module's aux data, kept on a frozen module (immutable: it cannot go stale; _copy and
    _freeze drop it), so every flatten after the first returns the same object."""
    d = module.__dict__
    aux = d.get("_aux")
    if aux is None:
        names = module._child_names
        aux = _Aux((names, tuple((k, v) for k, v in module._attrs() if k not in names)))
        if d.get("_frozen", False):
            d["_aux"] = aux
    return aux


def flatten_with_keys(module: Any):
    names = module._child_names
    children = tuple((jax.tree_util.GetAttrKey(n), module.__dict__[n]) for n in names)
    return children, _aux(module)


def flatten(module: Any):
    d = module.__dict__
    return tuple(d[n] for n in module._child_names), _aux(module)


def unflatten_for(cls: type) -> Callable:
    def unflatten(aux, children):
        names, static = aux
        obj = object.__new__(cls)
        d = obj.__dict__
        d.update(static)
        d.update(zip(names, children))
        d["_child_names"] = names
        d["_frozen"] = True
        if isinstance(aux, _Aux):
            d["_aux"] = aux
        return obj

    return unflatten
