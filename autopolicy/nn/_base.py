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

BOOKKEEPING = ("_frozen", "_child_names")


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


def flatten_with_keys(module: Any):
    names = module._child_names
    children = tuple((jax.tree_util.GetAttrKey(n), module.__dict__[n]) for n in names)
    static = tuple((k, v) for k, v in module._attrs() if k not in names)
    return children, (names, static)


def flatten(module: Any):
    names = module._child_names
    static = tuple((k, v) for k, v in module._attrs() if k not in names)
    return tuple(module.__dict__[n] for n in names), (names, static)


def unflatten_for(cls: type) -> Callable:
    def unflatten(aux, children):
        names, static = aux
        obj = object.__new__(cls)
        d = obj.__dict__
        d.update(static)
        d.update(zip(names, children))
        d["_child_names"] = names
        d["_frozen"] = True
        return obj

    return unflatten
