"""A measurement cache, so an interrupted tuning run resumes where it stopped.

Entries are JSON records under string keys built from the hardware fingerprint, the layer's
signature, the policy and the input shape (latency), or from a hash of the model's weights
(accuracy). The file is rewritten atomically after each new group of measurements: a kill at any
moment leaves either the previous complete file or the new one.

A cache on disk holds its directory's lock (:class:`autopolicy._rundir.RunLock`) from its
creation to :meth:`MeasurementCache.close`: a second run on the same directory is refused at
once, naming the process that holds it, since timings taken while two runs fight over the same
cores would spoil every later run that reuses them. Taking the lock removes the temporary files
of a killed run.

A cache may also read and feed a *shared* file (the command line's machine-wide cache, see
``autopolicy._machine_cache``): entries recorded with ``share=True`` (layer and cast timings,
keyed by the hardware fingerprint and the layer's signature) are merged into it at
:meth:`MeasurementCache.close`, and a key missing from the run's own entries is looked up there
(counted in ``shared_hits``, and copied into the run's own file so it stays complete).
Concurrent runs merging at the same moment may lose each other's newest shared entries (they
are measured again later), never corrupt the file (it is replaced atomically).

With several JAX processes (``jax.distributed``), only process 0 locks, reads and writes the
files; the others start from process 0's entries, broadcast, and keep theirs in memory (every
process records the same measurements, gathered, so none is lost).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable

import jax
import numpy as np

from autopolicy import _atomic, _interrupts, _json, _multihost, _rundir

__all__ = ["MeasurementCache", "key", "weights_digest"]

FILE_NAME = "measurements.json"


def key(*parts: Any) -> str:
    """A cache key from JSON-able parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:32]


def weights_digest(tree: Any) -> str:
    """A hash of every array (shape, dtype and bytes) in ``tree``.

    An array that spans processes contributes its shape, dtype, layout and this process's
    shards (never the whole array, which no host may hold); the processes' partial digests are
    then gathered and hashed together, so every process gets the same digest (a collective:
    every process calls this in the same order). Such a digest differs from an unsharded one.
    """
    digest, spans = hashlib.sha256(), False
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            spans = True
            digest.update(f"{leaf.shape}{leaf.dtype}{leaf.sharding}".encode())
            for shard in sorted(leaf.addressable_shards, key=lambda s: str(s.index)):
                digest.update(str(shard.index).encode())
                digest.update(np.ascontiguousarray(np.asarray(shard.data)).view(np.uint8).tobytes())
            continue
        arr = np.asarray(leaf)
        digest.update(f"{arr.shape}{arr.dtype}".encode())
        digest.update(np.ascontiguousarray(arr).view(np.uint8).tobytes())
    if spans:
        every = _multihost.gather_bytes(digest.digest())
        digest = hashlib.sha256(b"".join(every))
    return digest.hexdigest()[:32]


class MeasurementCache:
    """A dict of measurements persisted in ``directory`` (or kept in memory when None).

    Use it as a context manager (or call :meth:`close`): that writes what is new and gives the
    directory's lock back. Reads through :meth:`lookup` and :meth:`get_or_measure` are counted
    in ``hits`` and ``misses``.

    Args:
      directory: Where ``measurements.json`` lives (created if missing), or None.

    Raises:
      TypeError: if ``directory`` is not None, a str or os.PathLike.
      autopolicy._rundir.RunDirectoryLocked: if another process (or another open cache of this
        process) holds the directory; the message names its process id.
      NotADirectoryError, PermissionError, OSError: if the directory cannot be created or
        written.
      ValueError: if ``measurements.json`` is damaged (the message names it and says to delete
        it).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with MeasurementCache(d) as cache:
    ...         cache.get_or_measure("k", lambda: 1.5)
    ...     with MeasurementCache(d) as cache:
    ...         cache.lookup("k"), cache.lookup("other"), cache.hits, cache.misses
    1.5
    (1.5, None, 1, 0)
    """

    def __init__(self, directory: str | os.PathLike | None, shared: str | os.PathLike | None = None):
        self.path = None
        self.entries: dict[str, Any] = {}
        self.hits = 0
        self.misses = 0
        self.shared_hits = 0
        self.shared_path = None if shared is None else os.fspath(shared)
        self._shared: dict[str, Any] = {}
        self._to_share: dict[str, Any] = {}
        self._dirty = False
        self._closed = False
        self._lock: _rundir.RunLock | None = None
        if _multihost.count() > 1:
            self._open_on_leader(directory)
        else:
            self._open(directory)

    def _open(self, directory: str | os.PathLike | None) -> None:
        """Reads the shared file, locks ``directory`` and reads its entries."""
        if self.shared_path is not None:
            try:
                self._shared = _read(self.shared_path)
            except ValueError:  # a damaged shared file is measured again and replaced at close
                self._shared = {}
        if directory is None:
            return
        self._lock = _rundir.RunLock(_json.check_path(directory, "cache_dir"), "cache directory").acquire()
        self.path = os.path.join(self._lock.directory, FILE_NAME)
        try:
            self.entries = _read(self.path)
        except BaseException:
            self._lock.release()
            raise

    def _open_on_leader(self, directory: str | os.PathLike | None) -> None:
        """With several JAX processes, process 0 alone opens the files (it alone writes them) and
        every process starts from its entries, broadcast: all make the same cache hits, so all
        time and score the same programs. The other processes keep theirs in memory only."""
        error = None
        if _multihost.is_writer():
            try:
                self._open(directory)
            except Exception as e:  # pylint: disable=broad-except
                error = e
        else:
            self.shared_path = None
        state = _multihost.from_leader({"error": None if error is None else f"{type(error).__name__}: {error}",
                                        "entries": self.entries, "shared": self._shared})
        if error is not None:
            raise error
        if state["error"] is not None:
            raise RuntimeError(f"Process 0 could not open the measurement cache: {state['error']}")
        self.entries, self._shared = state["entries"], state["shared"]

    def get_or_measure(self, cache_key: str, measure: Callable[[], Any], share: bool = False) -> Any:
        """The cached value for ``cache_key``, or ``measure()`` (recorded, not yet flushed;
        ``share``: also offered to the shared file)."""
        if cache_key in self.entries or cache_key in self._shared:
            return self.lookup(cache_key)
        self.misses += 1
        return self._record(cache_key, measure(), share)

    def put(self, cache_key: str, value: Any, share: bool = False) -> Any:
        """Records ``value`` under ``cache_key``, replacing what was there (a re-measurement)."""
        self.misses += 1
        return self._record(cache_key, value, share)

    def _record(self, cache_key: str, value: Any, share: bool) -> Any:
        _interrupts.checkpoint()  # a Ctrl-C lost in a finalizer during the measurement stops here
        self.entries[cache_key] = value
        self._dirty = True
        if share and self.shared_path is not None:
            self._to_share[cache_key] = value
        return value

    def lookup(self, cache_key: str) -> Any:
        """The cached value for ``cache_key`` (counted as a hit; from the shared file, also in
        ``shared_hits``), or None (not counted)."""
        if cache_key in self.entries:
            self.hits += 1
            return self.entries[cache_key]
        if cache_key in self._shared:
            self.hits += 1
            self.shared_hits += 1
            self.entries[cache_key] = self._shared[cache_key]
            self._dirty = True
            return self.entries[cache_key]
        return None

    def peek(self, cache_key: str) -> Any:
        """The cached value for ``cache_key`` (or None), neither counted nor copied from the
        shared file into this run's: for an entry read only to reuse part of it, whose user
        records what it used under a key of its own (a rerun then reads that one)."""
        if cache_key in self.entries:
            return self.entries[cache_key]
        return self._shared.get(cache_key)

    def __enter__(self) -> "MeasurementCache":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Writes what is new and gives the directory's lock back; the cache can still be read
        afterwards (not written). Closing twice is harmless."""
        if self._closed:
            return
        try:
            self.flush()
            self._merge_shared()
        finally:
            self._closed = True
            if self._lock is not None:
                self._lock.release()

    def __contains__(self, cache_key: str) -> bool:
        return cache_key in self.entries

    def flush(self) -> None:
        """Writes new measurements to disk (atomically).

        Raises:
          RuntimeError: if there is something to write after :meth:`close` (the lock is gone).
        """
        if self.path is not None and self._dirty:
            if self._closed:
                raise RuntimeError(f"The measurement cache {self.path!r} is closed: new measurements cannot be "
                                   "written after close().")
            _atomic.write_text(self.path, json.dumps(self.entries, allow_nan=True))
            self._dirty = False


    def _merge_shared(self) -> None:
        """Adds this run's shareable measurements to the shared file (re-read first: other runs
        may have added theirs)."""
        if self.shared_path is None or not self._to_share:
            return
        try:
            current = _read(self.shared_path)
        except ValueError:
            current = {}
        current.update(self._to_share)
        os.makedirs(os.path.dirname(os.path.abspath(self.shared_path)), exist_ok=True)
        _atomic.write_text(self.shared_path, json.dumps(current, allow_nan=True))
        self._to_share = {}


def _read(path: str) -> dict[str, Any]:
    """The entries in ``path`` ({} when there is no file yet)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return {}
    try:
        loaded = _json.loads(raw, "it", "a JSON object")
    except ValueError as e:
        raise ValueError(f"The measurement cache {path!r} is damaged ({e}); delete it to measure again.") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"The measurement cache {path!r} is damaged (it holds a JSON {type(loaded).__name__}, "
                         "not an object); delete it to measure again.")
    return loaded
