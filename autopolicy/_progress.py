"""Progress of a run's phases: bars on a terminal, one line per phase elsewhere.

On a terminal (``sys.stderr.isatty()``), a phase is a tqdm bar, cleared when it ends. When
stderr is a file or a pipe (CI logs, ``2> log``), bars would be noise: each phase writes one
line to stderr when it ends, with its item count and wall time:

>>> import io, sys
>>> stderr, sys.stderr = sys.stderr, io.StringIO()
>>> try:
...     _ = [i for i in progress(True, range(3), "layer latency")]
...     line = sys.stderr.getvalue()
... finally:
...     sys.stderr = stderr
>>> line.startswith("autopolicy: layer latency: 3/3 in ") and line.endswith(" s\\n")
True
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator

__all__ = ["progress", "progress_bar", "PhaseLine"]


def _on_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class PhaseLine:
    """A progress bar's interface (``update``, ``set_postfix``, ``close``) that writes one line
    to stderr on ``close``: ``autopolicy: <desc>: <done>[/<total>] in <seconds> s[ (<postfix>)]``."""

    def __init__(self, desc: str, total: int | None = None):
        self.desc, self.total, self.n, self.postfix = desc, total, 0, ""
        self._start = time.perf_counter()
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        extra = f" ({self.postfix})" if self.postfix else ""
        sys.stderr.write(f"autopolicy: {self.desc}: {count} in {time.perf_counter() - self._start:.1f} s{extra}\n")
        sys.stderr.flush()


def progress_bar(enabled: bool, total: int | None, desc: str, unit: str = "it") -> Any:
    """A bar (``update``/``set_postfix``/``close``) on a terminal, a :class:`PhaseLine`
    elsewhere, None when disabled."""
    if not enabled:
        return None
    if not _on_terminal():
        return PhaseLine(desc, total)
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel

    return tqdm(total=total, desc=desc, unit=unit, leave=False)


def _lines(iterable: Iterable, line: PhaseLine) -> Iterator:
    try:
        for item in iterable:
            line.update()  # counts the items handed out
            yield item
    finally:  # also when the loop stops early (a break closes the generator)
        line.close()


def progress(enabled: bool, iterable: Iterable, desc: str, total: int | None = None) -> Iterable:
    """``iterable`` with a progress bar (a terminal) or a line when it ends (elsewhere); the
    iterable itself when disabled."""
    if not enabled:
        return iterable
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if not _on_terminal():
        return _lines(iterable, PhaseLine(desc, total))
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel

    return tqdm(iterable, desc=desc, total=total, leave=False)
