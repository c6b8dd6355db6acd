"""A measurement cache, so an interrupted tuning run resumes where it stopped.

Entries are JSON records under string keys built from the hardware fingerprint, the layer's
signature, the policy and the input shape (latency), or from a hash of the model's weights
(accuracy). The file is rewritten atomically after each new group of measurements: a kill at any
moment leaves either the previous complete file or the new one.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable

import jax
import numpy as np

from autopolicy import _atomic

__all__ = ["MeasurementCache", "key", "weights_digest"]

FILE_NAME = "measurements.json"


def key(*parts: Any) -> str:
    """A cache key from JSON-able parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:32]


def weights_digest(tree: Any) -> str:
    """A hash of every array (shape, dtype and bytes) in ``tree``."""
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        arr = np.asarray(leaf)
        digest.update(f"{arr.shape}{arr.dtype}".encode())
        digest.update(np.ascontiguousarray(arr).view(np.uint8).tobytes())
    return digest.hexdigest()[:32]


class MeasurementCache:
    """A dict of measurements persisted in ``directory`` (or kept in memory when None)."""

    def __init__(self, directory: str | os.PathLike | None):
        self.path = None if directory is None else os.path.join(directory, FILE_NAME)
        self.entries: dict[str, Any] = {}
        self.hits = 0
        self.misses = 0
        if self.path is not None and os.path.exists(self.path):
            try:
                with open(self.path, encoding="utf-8") as f:
                    loaded = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"The measurement cache {self.path!r} is unreadable ({e}); delete it to start over."
                ) from None
            if not isinstance(loaded, dict):
                raise ValueError(f"The measurement cache {self.path!r} is not a JSON object; delete it.")
            self.entries = loaded
        self._dirty = False

    def get_or_measure(self, cache_key: str, measure: Callable[[], Any]) -> Any:
        """The cached value for ``cache_key``, or ``measure()`` (recorded, not yet flushed)."""
        if cache_key in self.entries:
            self.hits += 1
            return self.entries[cache_key]
        self.misses += 1
        value = measure()
        self.entries[cache_key] = value
        self._dirty = True
        return value

    def put(self, cache_key: str, value: Any) -> Any:
        """Records ``value`` under ``cache_key``, replacing what was there (a re-measurement)."""
        self.misses += 1
        self.entries[cache_key] = value
        self._dirty = True
        return value

    def lookup(self, cache_key: str) -> Any:
        """The cached value for ``cache_key`` (counted as a hit), or None (not counted)."""
        if cache_key in self.entries:
            self.hits += 1
            return self.entries[cache_key]
        return None

    def __enter__(self) -> "MeasurementCache":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Writes what is new; the cache can still be read afterwards."""
        self.flush()

    def __contains__(self, cache_key: str) -> bool:
        return cache_key in self.entries

    def flush(self) -> None:
        """Writes new measurements to disk (atomically)."""
        if self.path is not None and self._dirty:
            _atomic.write_text(self.path, json.dumps(self.entries, allow_nan=True))
            self._dirty = False
