"""Progress bars for the phases of a run (shown only on a terminal)."""

from __future__ import annotations

from typing import Iterable


def progress(enabled: bool, iterable: Iterable, desc: str, total: int | None = None):
    """A progress bar over ``iterable``, or ``iterable`` itself when disabled."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel

    return tqdm(iterable, desc=desc, total=total, leave=False, disable=None)  # None: off without a TTY
