"""Per-thread state of a forward pass: building, the training flag, dropout keys, call hooks.

Modules are pure pytrees; what a single call needs beyond its arguments (a key to build weights
with, a key for dropout, a recorder for the search) lives here for the duration of the call.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from typing import Any, Callable, Iterator

import jax

_state = threading.local()


def _get(name: str, default: Any = None) -> Any:
    return getattr(_state, name, default)


@contextlib.contextmanager
def _setting(name: str, value: Any) -> Iterator[Any]:
    previous = _get(name)
    setattr(_state, name, value)
    try:
        yield value
    finally:
        setattr(_state, name, previous)


def path_key(key: jax.Array, path: str) -> jax.Array:
    """A key for ``path`` that does not depend on the order in which layers are visited."""
    return jax.random.fold_in(key, zlib.crc32(path.encode("utf-8")) & 0x7FFFFFFF)


# --- building ---------------------------------------------------------------------------------


class BuildState:
    """Collects the weights layers ask for while a model is being built.

    The build pass runs traced (shapes only); weights are zero placeholders whose real values
    are drawn afterwards, outside the trace, from these requests.
    """

    __slots__ = ("key", "requests")

    def __init__(self, key: jax.Array):
        self.key = key
        self.requests: list[tuple[Any, dict]] = []


def building(state: BuildState):
    return _setting("build_state", state)


def build_state() -> BuildState | None:
    return _get("build_state")


# --- the call stack (training flag inheritance, call order) ------------------------------------


class _Frame:
    __slots__ = ("module", "training")

    def __init__(self, module: Any, training: bool):
        self.module = module
        self.training = training


def stack() -> list[_Frame]:
    frames = _get("stack")
    if frames is None:
        frames = []
        _state.stack = frames
    return frames


@contextlib.contextmanager
def frame(module: Any, training: bool) -> Iterator[None]:
    frames = stack()
    frames.append(_Frame(module, training))
    try:
        yield
    finally:
        frames.pop()


def inherited_training() -> bool:
    frames = stack()
    return frames[-1].training if frames else False


def caller() -> Any:
    frames = stack()
    return frames[-1].module if frames else None


# --- randomness for dropout -------------------------------------------------------------------


class _RngState:
    __slots__ = ("key", "counts")

    def __init__(self, key: jax.Array):
        self.key = key
        self.counts: dict[str, int] = {}

    def next_key(self, path: str) -> jax.Array:
        count = self.counts.get(path, 0)
        self.counts[path] = count + 1
        return jax.random.fold_in(path_key(self.key, path), count)


@contextlib.contextmanager
def rng_scope(key: jax.Array) -> Iterator[None]:
    """Provides randomness (dropout masks) to every layer called inside the block.

    Each layer derives its own key from ``key`` and its path, so the masks do not depend on the
    order in which layers run; a layer called twice gets two different masks.

    >>> import autopolicy.nn as nn, jax, jax.numpy as jnp
    >>> drop = nn.Dropout(0.5).build(jax.random.key(0), jnp.ones(4))
    >>> with nn.rng_scope(jax.random.key(1)):
    ...     y = drop(jnp.ones(1000), training=True)
    >>> 400 < int((y == 0).sum()) < 600
    True
    """
    with _setting("rng", _RngState(key)):
        yield


def rng_active() -> bool:
    return _get("rng") is not None


def next_rng_key(path: str) -> jax.Array | None:
    rng = _get("rng")
    return None if rng is None else rng.next_key(path)


# --- call hooks (the search records each layer's inputs) ---------------------------------------

# A hook sees (layer, args, kwargs) before the layer runs; it may return a callback that then
# receives the layer's output, and whose result, unless None, replaces that output (the search
# adds a zero to each layer's output this way, to take the loss's gradient with respect to it).
Hook = Callable[[Any, tuple, dict], Any]


@contextlib.contextmanager
def call_hook(hook: Hook) -> Iterator[None]:
    hooks = list(_get("hooks") or ()) + [hook]
    with _setting("hooks", hooks):
        yield


def hooks() -> list[Hook]:
    return _get("hooks") or []


# --- weight calibration (GPTQ, AWQ) ------------------------------------------------------------


@contextlib.contextmanager
def calibrating() -> Iterator[None]:
    """Inside the block, layers whose quantized weights await calibration run their float kernel
    (``calibrate_weights`` collects their inputs this way); outside it they raise."""
    with _setting("calibrating", True):
        yield


def is_calibrating() -> bool:
    return bool(_get("calibrating"))
