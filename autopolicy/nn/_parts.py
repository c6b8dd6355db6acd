"""Models compiled by parts (:meth:`autopolicy.nn.Module.compiled_by_parts`).

Each child a model compiled by parts calls from Python runs as its own jitted part, keyed by the
child's tree structure less its names and paths: the blocks of a transformer share one
compilation, and a model that differs from another in one layer compiles only the part holding
it. A :class:`PartOutputs` shared by such models also reuses the outputs of parts that run
again on the same weights and equal inputs.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import threading
from typing import Any, Callable

import jax
import numpy as np

from autopolicy.nn import _base, _context
from autopolicy.nn._base import is_array

__all__ = ["PartOutputs", "compiles_part", "call_part"]

# Static attributes that never change what a module computes (names, paths, the serialized
# configuration, how the name and the policy were given): parts that differ only in them share
# one compilation.
_NAMELESS = frozenset(("name", "path", "_config", "_auto_named", "_dtype_explicit"))


class _Part:
    """A part's jit key: its tree structure less its names and paths (:data:`_NAMELESS`), hashed
    once. ``treedef`` rebuilds the part inside the trace (any part of that key computes the same)."""

    __slots__ = ("key", "treedef", "hash")

    def __init__(self, treedef: Any):
        self.treedef = treedef
        self.key = _nameless(treedef)
        self.hash = hash(self.key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Part) and self.hash == other.hash and self.key == other.key


def _nameless(treedef: Any) -> Any:
    data = treedef.node_data()
    if data is None:
        return None
    kind, aux = data
    if isinstance(aux, _base._Aux):  # pylint: disable=protected-access
        names, static = aux
        aux = (names, tuple((k, v) for k, v in static if k not in _NAMELESS))
    elif isinstance(aux, list):  # a dict's keys
        aux = tuple(aux)
    return kind, aux, tuple(_nameless(c) for c in treedef.children())


@functools.lru_cache(maxsize=4096)
def _part(treedef: Any) -> _Part:
    return _Part(treedef)


def compiles_part(module: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a child of a model compiled by parts runs as its own compiled part: from plain
    Python, on concrete arrays (inside a part's trace the child is traced as usual)."""
    if not module.__dict__.get("_frozen", False) or not module._own_built:  # pylint: disable=protected-access
        return False
    if _context.build_state() is not None or _context.hooks() or _context.rng_active():
        return False
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    return all(is_array(x) and not isinstance(x, jax.core.Tracer) for x in leaves)


@functools.partial(jax.jit, static_argnames=("part", "training"))
def _jit_part(leaves: list, args: tuple, kwargs: dict, part: _Part, training: bool) -> Any:
    module = jax.tree_util.tree_unflatten(part.treedef, leaves)
    return module(*args, training=training, **kwargs)


def call_part(module: Any, args: tuple, kwargs: dict, training: bool, model: Any) -> Any:
    """``module(*args, **kwargs)`` as a compiled part of ``model`` (the model compiled by parts
    that calls it); through the model's :class:`PartOutputs` where it has one."""
    leaves, treedef = jax.tree_util.tree_flatten(module)
    part = _part(treedef)

    def run() -> Any:
        return _jit_part(leaves, args, kwargs, part=part, training=training)

    reuse = model.__dict__.get("_part_outputs")
    return run() if reuse is None else reuse.get_or_run(part, leaves, (args, kwargs), training, run, model)


class PartOutputs:
    """The outputs of compiled parts, reused where a part runs again on the same weights and
    equal inputs: shared by models that differ in one layer (the search's sensitivity scores),
    it skips the float32 parts before the one that differs, which compute the same outputs for
    every such model.

    A call's key is the part's structure (names aside), the identity of its weight arrays and a
    digest (BLAKE2b) of its inputs' bytes, shapes and dtypes. An output is kept when a second
    model calls the part with its key (the parts after the changed layer run for one model only,
    however often it is called, and are never kept), with the weight arrays it was computed
    from (so their identities cannot be reused while it is kept), least recently used first out
    past ``max_bytes`` of outputs. Reused outputs are the same arrays: bit for bit what the part
    would compute again.

    Args:
      max_bytes: The most bytes of outputs kept (default 256 MiB); an output larger than a
        quarter of it is never kept.

    Raises:
      ValueError: for a ``max_bytes`` that is not a positive int.
    """

    def __init__(self, max_bytes: int = 256 << 20):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int. Received: max_bytes={max_bytes!r}")
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._kept: collections.OrderedDict[tuple, tuple[list, Any, int]] = collections.OrderedDict()
        self._seen: dict[tuple, int] = {}  # key -> id of the first model that ran it
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The bytes of the outputs kept now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        """Drops every kept output (and what was seen)."""
        with self._lock:
            self._kept.clear()
            self._seen.clear()
            self._bytes = 0

    def get_or_run(self, part: Any, leaves: list, inputs: Any, training: bool, run: Callable[[], Any],
                   model: Any) -> Any:
        """The part's output: kept from an earlier call, or ``run()`` (for ``model``)."""
        key = (part, tuple(map(id, leaves)), training, _digest(inputs))
        with self._lock:
            entry = self._kept.get(key)
            if entry is not None:
                self._kept.move_to_end(key)
                self.hits += 1
                return entry[1]
            self.misses += 1
        out = run()
        size = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(out) if is_array(x))
        with self._lock:
            first = self._seen.get(key)
            if first is None or first == id(model):  # (an id reused by another model: kept later)
                if len(self._seen) >= 1 << 18:  # bounded on very long runs
                    self._seen.clear()
                self._seen[key] = id(model)
            elif size <= self.max_bytes // 4 and key not in self._kept:
                self._kept[key] = (list(leaves), out, size)
                self._bytes += size
                while self._bytes > self.max_bytes:
                    _, (_, _, dropped) = self._kept.popitem(last=False)
                    self._bytes -= dropped
        return out


def _digest(tree: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    h = hashlib.blake2b(digest_size=16)
    for x in leaves:
        a = np.ascontiguousarray(np.asarray(x))
        h.update(f"{a.shape}{a.dtype};".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return treedef, h.digest()
