"""Names and paths: a parent names its children uniquely and their subtrees carry full paths."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import jax

from autopolicy.nn import _context
from autopolicy.nn._base import dedupe, is_dynamic, is_module, map_children

__all__ = ["Naming"]


class Naming:
    """Children, names and paths of a module (a mixin of ``Module``)."""

    def _child_items(self) -> list[tuple[str, bool, Any]]:
        """(attribute, is the attribute itself the module, module) for every direct child."""
        items = []
        for key, value in self._attrs():
            if is_module(value):
                items.append((key, True, value))
            elif is_dynamic(value):
                for leaf in jax.tree_util.tree_leaves(value, is_leaf=is_module):
                    if is_module(leaf):
                        items.append((key, False, leaf))
        return items

    def children(self) -> list[Any]:
        """The direct submodules, in the order they were first called (then definition order)."""
        kids = [m for _, _, m in self._child_items()]
        order = {name: i for i, name in enumerate(self._call_order)}
        return sorted(kids, key=lambda m: order.get(m.name, len(order)))

    def _adopt_children(self, only_new: bool = False) -> None:
        """Names the direct children uniquely and sets paths in their subtrees (copying them).

        With ``only_new``, only children created since the last adoption (while building, e.g.
        a projection whose size depends on the input) are named; the others keep theirs.
        """
        items = self._child_items()
        prefix = self.path + "/"
        adopted = {id(m) for _, _, m in items if only_new and m.path.startswith(prefix)}
        explicit = [m.name for _, _, m in items if not m._auto_named or id(m) in adopted]
        duplicates = sorted({n for n in explicit if explicit.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"Names of the children of {self.path!r} must be unique. Duplicated: {duplicates}"
            )
        used = set(explicit)
        mutable = not self.__dict__.get("_frozen", True) and _context.build_state() is not None
        renamed: dict[int, Any] = {}
        for attr, single, child in items:
            if id(child) in renamed or id(child) in adopted:
                continue
            if child._auto_named:
                base = attr.lstrip("_") if single else type(child)._class_default_name()
                name = dedupe(base or type(child)._class_default_name(), used)
            else:
                name = child.name
            used.add(name)
            renamed[id(child)] = child._with_path(name, prefix + name, self._inherited(), freeze=not mutable)
        if renamed:
            map_children(self, lambda child: renamed.get(id(child), child))

    def _inherited(self) -> Any:
        """The policy source this module hands to children that were not given a dtype."""
        return self._policy_source if self._dtype_explicit else None

    def _with_path(self, name: str, path: str, inherited: Any = None, freeze: bool = True) -> Any:
        changes: dict[str, Any] = {"name": name, "path": path}
        if inherited is not None and not self._dtype_explicit:
            changes["_policy_source"] = inherited
        new = self._copy(mutable=True, **changes)
        own = new._inherited()
        handed_down = own if own is not None else (None if self._dtype_explicit else inherited)
        map_children(new, lambda x: x._with_path(x.name, f"{path}/{x.name}", handed_down, freeze))
        if freeze:
            new._freeze()
        return new

    def modules(self) -> "OrderedDict[str, Any]":
        """Every module of the tree (this one first) by path, parents before children."""
        out: OrderedDict[str, Any] = OrderedDict()

        def visit(m) -> None:
            out[m.path] = m
            for child in m.children():
                visit(child)

        visit(self)
        return out

    def layers_by_path(self) -> "OrderedDict[str, Any]":
        """The leaf layers by path, in execution order (as recorded when the model was built).

        >>> import autopolicy.nn as nn
        >>> mlp = nn.Sequential([nn.Dense(8), nn.Dense(2)], name="mlp")
        >>> list(mlp.layers_by_path())
        ['mlp/dense', 'mlp/dense_1']
        """
        return OrderedDict((p, m) for p, m in self.modules().items() if not m.children())
