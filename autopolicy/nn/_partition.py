"""Splitting a model's arrays by role: trained parameters, frozen state, float8 scaling state.

- ``"param"``: floating weights an optimizer updates.
- ``"frozen"``: int8 kernels and their scales, weights created with ``trainable=False``.
- ``"fp8"``: float8 amax histories and scales, updated by overwrite-with-gradient (see
  :mod:`autopolicy.numerics.float8`), never by an optimizer or a loss scale.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autopolicy.nn._module import Module

__all__ = ["KINDS", "leaf_kinds", "partition", "combine"]

KINDS = ("param", "frozen", "fp8")
_FP8_ATTRIBUTE = "fp8"


def _kind(model: Module, path: tuple) -> str:
    obj: Any = model
    owner, attr = model, None
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            if isinstance(obj, Module):
                owner, attr = obj, key.name
            obj = getattr(obj, key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            obj = obj[key.idx]
        elif isinstance(key, jax.tree_util.DictKey):
            obj = obj[key.key]
        else:  # pragma: no cover - every container in a module is one of the three
            raise TypeError(f"Unexpected key {key!r} in a model")
        if attr == _FP8_ATTRIBUTE and owner is not None:
            return "fp8"
    if attr in owner._nontrainable or not jnp.issubdtype(jnp.result_type(obj), jnp.floating):
        return "frozen"
    return "param"


def leaf_kinds(model: Module) -> Any:
    """A tree shaped like ``model`` whose leaves are ``"param"``, ``"frozen"`` or ``"fp8"``."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
    return jax.tree_util.tree_unflatten(treedef, [_kind(model, path) for path, _ in leaves])


def partition(model: Module, *kinds: str) -> tuple[Any, Any]:
    """``(selected, rest)``: two copies of ``model`` with None in place of the other leaves.

    >>> import autopolicy.nn as nn
    >>> m = nn.Dense(2).build(jax.random.key(0), jnp.ones((1, 3))).quantize("int8")
    >>> params, rest = partition(m, "param")
    >>> params.kernel is None, rest.kernel.dtype
    (True, dtype('int8'))
    """
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"Expected kinds from {KINDS}. Received: {kinds!r}")
    labels = leaf_kinds(model)
    selected = jax.tree_util.tree_map(lambda x, k: x if k in kinds else None, model, labels)
    rest = jax.tree_util.tree_map(lambda x, k: None if k in kinds else x, model, labels)
    return selected, rest


def combine(*trees: Any) -> Any:
    """Merges trees from :func:`partition` (the first non-None leaf wins)."""

    def pick(*xs):
        for x in xs:
            if x is not None:
                return x
        return None

    return jax.tree_util.tree_map(pick, *trees, is_leaf=lambda x: x is None)
