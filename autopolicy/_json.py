"""Strict reading of the JSON files autopolicy loads: paths checked, duplicate keys refused.

``json.loads`` keeps the last of two equal keys without a word; a hand-edited policy map with a
repeated layer path would silently lose an entry (while ``DTypePolicyMap`` itself refuses
duplicates), so every file autopolicy reads goes through :func:`loads`.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["check_path", "loads", "read"]


def check_path(path: Any, argument: str = "path") -> str:
    """``path`` as a string, if it is a ``str`` or ``os.PathLike`` (an int would be read as an
    open file descriptor by ``open``).

    Raises:
      TypeError: naming the type of anything else.

    >>> check_path(3)
    Traceback (most recent call last):
    ...
    TypeError: path must be a str or os.PathLike. Received: path=3 of type int
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{argument} must be a str or os.PathLike. Received: {argument}={path!r} of type {type(path).__name__}"
        )
    return os.fspath(path)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def loads(data: bytes | str, source: str, expected: str = "valid JSON") -> Any:
    """Parses JSON text, refusing duplicate keys.

    Args:
      data: UTF-8 bytes or text.
      source: Where the text comes from (a file name), for error messages.
      expected: What the text should be, for error messages (``"<source> is not <expected>"``).

    Raises:
      ValueError: for text that is not UTF-8 JSON, nests too deeply, or repeats a key in an
        object; the message names ``source`` and the key.

    >>> loads('{"a": 1, "a": 2}', "map.json")
    Traceback (most recent call last):
    ...
    ValueError: map.json is not valid JSON: duplicate key 'a'
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"{source} is not {expected}: {e}") from None
    except RecursionError:
        raise ValueError(f"{source} is not {expected}: it nests too deeply") from None


def read(path: Any, argument: str = "path", expected: str = "valid JSON") -> Any:
    """Reads and parses the JSON file at ``path`` with :func:`loads`.

    Raises:
      TypeError: if ``path`` is not a str or os.PathLike.
      FileNotFoundError: if it does not exist.
      ValueError: as :func:`loads`.
    """
    path = check_path(path, argument)
    with open(path, "rb") as f:
        raw = f.read()
    return loads(raw, repr(path), expected)
