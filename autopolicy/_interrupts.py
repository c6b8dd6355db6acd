"""Ctrl-C that is never lost.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when SIGINT is
handled. When that is inside a finalizer (an array's ``__del__``, a weakref callback run by the
garbage collector), the exception cannot propagate: Python prints it as "Exception ignored
in ..." and carries on, so the user's Ctrl-C is silently dropped and the run goes on to the end.

:func:`catching` installs a SIGINT handler that records the interrupt before raising, and an
unraisable hook that drops such swallowed interrupts quietly; :func:`checkpoint` (called for
every measurement the tuner records) raises the recorded interrupt at the next safe point, and
:func:`pending` lets the command line report it even when the work finished first.

>>> with catching():
...     _mark()  # as the handler does, before its KeyboardInterrupt is lost in a finalizer
...     try:
...         checkpoint()
...     except KeyboardInterrupt:
...         print("raised at the checkpoint")
raised at the checkpoint
>>> pending()
False
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Iterator

__all__ = ["catching", "checkpoint", "pending"]

_state = {"pending": False, "active": False}


def _mark() -> None:
    _state["pending"] = True


def _handler(signum: int, frame: Any) -> None:  # pylint: disable=unused-argument
    _mark()
    raise KeyboardInterrupt


def pending() -> bool:
    """Whether a Ctrl-C arrived inside :func:`catching` (and has not been raised at a checkpoint)."""
    return _state["pending"]


def checkpoint() -> None:
    """Raises ``KeyboardInterrupt`` if a Ctrl-C arrived and was swallowed (in a finalizer); a
    no-op otherwise, or outside :func:`catching`."""
    if _state["pending"] and _state["active"]:
        _state["pending"] = False
        raise KeyboardInterrupt


def _unraisable(previous: Any) -> Any:
    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _mark()  # raised again at the next checkpoint, and never printed as "Exception ignored"
            return
        previous(unraisable)

    return hook


@contextlib.contextmanager
def catching() -> Iterator[None]:
    """Within the block, a Ctrl-C is recorded before it is raised, and one raised inside a
    finalizer is raised again at the next :func:`checkpoint` instead of being lost. Outside the
    main thread (where signals cannot be handled) only the bookkeeping is installed."""
    _state["pending"] = False
    previous_handler = None
    if threading.current_thread() is threading.main_thread():
        previous_handler = signal.signal(signal.SIGINT, _handler)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _unraisable(previous_hook)
    _state["active"] = True
    try:
        yield
    finally:
        _state["active"] = False
        sys.unraisablehook = previous_hook
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)
