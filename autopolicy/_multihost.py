"""Several JAX processes tuning one model together (``jax.distributed``, multi-controller JAX).

Every process runs the same programs in the same order: a program over a mesh that spans the
processes runs only when each of them launches it. So every decision the tuner makes must be
the same on each process, and it is made only from values that are: timings gathered with the
slowest process's counting (:func:`slowest`), figures broadcast from process 0
(:func:`from_leader`), metrics checked to agree (:func:`agreed`), and arrays that span
processes read whole on each (:func:`host_array`). Only process 0 writes files
(:func:`is_writer`). With one process every function here is the identity, and costs nothing.

>>> float(slowest(np.array([1.0, 2.0]))[1]), is_writer(), from_leader({"a": 1})
(2.0, True, {'a': 1})
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import jax
import numpy as np

__all__ = ["count", "is_writer", "host_array", "gather_bytes", "slowest", "from_leader", "agreed", "check_same"]


def count() -> int:
    """How many JAX processes take part (1 without ``jax.distributed``)."""
    return jax.process_count()


def is_writer() -> bool:
    """Whether this process writes the run's files (process 0 only)."""
    return jax.process_index() == 0


def host_array(x: Any, dtype: Any = None) -> np.ndarray:
    """``x`` as a NumPy array on this host: an array that spans processes is gathered whole on
    every process (a collective: every process must call this in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x, dtype)


def _gather(values: np.ndarray) -> np.ndarray:
    """Every process's ``values`` (same shape on each), stacked along a new first axis."""
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    return np.asarray(multihost_utils.process_allgather(values))


def gather_bytes(data: bytes) -> list[bytes]:
    """Every process's ``data`` (the same length on each), in process order."""
    if count() == 1:
        return [data]
    everyone = _gather(np.frombuffer(data, np.uint8))
    return [np.asarray(row, np.uint8).tobytes() for row in everyone]


def slowest(values: Any) -> np.ndarray:
    """Elementwise, the largest of every process's ``values`` (float64, same shape on each): a
    timing counts as the slowest process took it (a sharded program is as fast as its slowest
    host)."""
    values = np.asarray(values, np.float64)
    if count() == 1:
        return values
    return _gather(values).max(axis=0)


def from_leader(value: Any) -> Any:
    """Process 0's ``value`` (anything JSON can hold) on every process."""
    if count() == 1:
        return value
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    data = np.frombuffer(json.dumps(value, allow_nan=True).encode("utf-8"), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.array([data.size], np.int64))[0])
    padded = np.zeros(size, np.uint8)
    padded[:min(size, data.size)] = data[:size]
    received = np.asarray(multihost_utils.broadcast_one_to_all(padded), np.uint8)
    return json.loads(received.tobytes().decode("utf-8"))


def agreed(value: float, what: str) -> float:
    """``value`` when every process computed the same one (NaN equals NaN), else a ValueError
    listing them: a metric must be computed the same on every process.

    Raises:
      ValueError: if the processes' values differ.
    """
    if count() == 1:
        return value
    values = [float(v) for v in _gather(np.array([value], np.float64))[:, 0]]
    first = values[0]
    if any(not (v == first or (math.isnan(v) and math.isnan(first))) for v in values):
        raise ValueError(f"{what} differs between processes: {values} (process 0 first). With several JAX "
                         "processes it must return the same value on each: compute it on global arrays (a "
                         "reduction over the whole batch), not on a process's own shard.")
    return value


def check_same(value: Any, what: str) -> None:
    """Raises unless every process holds the same ``value`` (compared by a hash of its JSON).

    Raises:
      RuntimeError: naming ``what`` and the processes that differ from process 0.
    """
    if count() == 1:
        return
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode("utf-8")).digest()[:8]
    mine = np.frombuffer(digest, np.uint8).astype(np.int32)
    everyone = _gather(mine)
    differ = [i for i in range(everyone.shape[0]) if not np.array_equal(everyone[i], everyone[0])]
    if differ:
        raise RuntimeError(f"The processes disagree on {what}: processes {differ} differ from process 0. The tuner "
                           "decides only from values gathered from or broadcast to every process; a difference "
                           "means a process saw other inputs (model, data, eval_fn, candidates) or a bug.")
