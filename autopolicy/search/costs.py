"""The tuner's own cost: wall time per phase and XLA compilations, for ``summary.json``.

A :class:`Costs` is made active with ``with costs:``; inside, :func:`phase` charges the wall
time of a block to a named phase of the active one (and is free when none is active, so search
code marks its phases without being handed anything). Phases nest: time is charged to the
innermost phase only, so the phases add up to the measured wall time. While active, every XLA
compilation in the process is counted through ``jax.monitoring``: each backend compile request
(``/jax/core/compile/backend_compile_duration``, fired for a compilation and for a load from
the persistent compilation cache alike), and the loads among them
(``/jax/compilation_cache/cache_hits``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from typing import Any, Iterator

from jax import monitoring

__all__ = ["PHASES", "Costs", "phase"]

#: The phases, in the order a run goes through them (the summary lists them in this order).
PHASES = ("checks", "layer latency", "casts", "calibration", "sensitivity", "solve", "end-to-end rounds",
          "verify", "report")

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_ACTIVE: contextvars.ContextVar["Costs | None"] = contextvars.ContextVar("autopolicy_costs", default=None)


class Costs:
    """Wall seconds per phase and compilations counted while active (``with costs: ...``).

    >>> costs = Costs()
    >>> with costs:
    ...     with phase("solve"):
    ...         pass
    >>> sorted(costs.seconds), costs.compilations >= 0
    (['solve'], True)
    >>> with phase("solve"):  # no active Costs: nothing is charged
    ...     pass
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.compilations = 0
        self.compile_cache_hits = 0
        self.compile_s = 0.0
        self._stack: list[list[Any]] = []  # [name, start of the current uncharged stretch]
        self._lock = threading.Lock()
        self._token: contextvars.Token | None = None

    # --- compilations, counted from any thread ---
    def _on_duration(self, event: str, seconds: float, **_: Any) -> None:
        if event == _COMPILE_EVENT:
            with self._lock:
                self.compilations += 1
                self.compile_s += float(seconds)

    def _on_event(self, event: str, **_: Any) -> None:
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self.compile_cache_hits += 1

    def __enter__(self) -> "Costs":
        if self._token is not None:
            raise RuntimeError("This Costs is already active; make a new one for another run.")
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        _ACTIVE.reset(self._token)
        self._token = None
        monitoring.unregister_event_duration_listener(self._on_duration)
        monitoring.unregister_event_listener(self._on_event)

    # --- phases ---
    def _charge(self, now: float) -> None:
        if self._stack:
            name, since = self._stack[-1]
            self.seconds[name] = self.seconds.get(name, 0.0) + (now - since)
            self._stack[-1][1] = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charges the block's wall time (less that of phases nested in it) to ``name``."""
        if name not in PHASES:
            raise ValueError(f"Unknown phase {name!r}; the phases are {list(PHASES)}.")
        self._charge(time.perf_counter())
        self._stack.append([name, time.perf_counter()])
        try:
            yield
        finally:
            self._charge(time.perf_counter())
            self._stack.pop()
            if self._stack:
                self._stack[-1][1] = time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        """Charges ``seconds`` measured elsewhere (such as the report, written after the run) to ``name``."""
        if name not in PHASES:
            raise ValueError(f"Unknown phase {name!r}; the phases are {list(PHASES)}.")
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)

    def as_dict(self) -> dict[str, Any]:
        """``{"phases_s": {phase: seconds} in PHASES order, "compilations", "compile_cache_hits", "compile_s"}``
        (the phase running now charged up to this moment)."""
        self._charge(time.perf_counter())
        return {"phases_s": {p: round(self.seconds[p], 3) for p in PHASES if p in self.seconds},
                "compilations": self.compilations, "compile_cache_hits": self.compile_cache_hits,
                "compile_s": round(self.compile_s, 3)}


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Charges the block to phase ``name`` of the active :class:`Costs` (nothing when none is active)."""
    costs = _ACTIVE.get()
    if costs is None:
        yield
        return
    with costs.phase(name):
        yield
