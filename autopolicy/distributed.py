"""Executors for ``tune(..., executor=...)``: accuracy work on other processes and machines.

``tune`` accepts any ``concurrent.futures.Executor`` (:mod:`autopolicy.search.executor` says
what it sends and how failures are handled). This module adds what a user would otherwise
write:

- :class:`RayExecutor`: Ray actors that keep the model, its float32 outputs and the compiled
  programs loaded for the whole run, placed with custom resources (to keep scoring off the
  target machine), the workload shipped once through Ray's object store, futures from
  ``ObjectRef.future()``. Needs ``pip install -e ".[distributed]"``.
- :func:`make_executor`: the command line's ``--executor`` values, ``processes:N`` (a pool of
  N spawned processes on this host) and ``ray`` / ``ray:N`` (a Ray cluster: ``--ray-address``,
  else ``RAY_ADDRESS``, else a local one).

Dask needs nothing from here: ``distributed.Client(...).get_executor()`` is an executor as it is.

>>> make_executor("threads")
Traceback (most recent call last):
...
ValueError: --executor must be one of 'processes:N' (N >= 1 worker processes on this host), 'ray' or 'ray:N' (Ray actors). Received: 'threads'
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import multiprocessing
import os
import re
import signal
import threading
from typing import Any, Callable, Iterator, Mapping

__all__ = ["RayExecutor", "make_executor", "running", "EXECUTOR_CHOICES"]

EXECUTOR_CHOICES = "'processes:N' (N >= 1 worker processes on this host), 'ray' or 'ray:N' (Ray actors)"


def _ray() -> Any:
    try:
        import ray  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError("RayExecutor needs Ray: pip install -e '.[distributed]' (or pip install 'ray>=2.40').") from e
    return ray


class _RayWorkloadRef:
    """A workload in Ray's object store (see ``search.executor.WorkloadRef``)."""

    def __init__(self, digest: str, blob: Any):
        self.digest = digest
        self.blob = [blob]  # inside a list: Ray passes the reference, the actor fetches it once

    def load(self) -> bytes:
        return _ray().get(self.blob[0])


class _Worker:
    """The actor: runs a task's function in its process (which keeps what it loads)."""

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def pid(self) -> int:
        return os.getpid()


class RayExecutor(concurrent.futures.Executor):
    """A ``concurrent.futures.Executor`` on Ray actors.

    Args:
      num_workers: Actors to start (default: the cluster's CPUs divided by ``num_cpus``).
      address: The cluster (``ray.init(address=...)``); None: ``RAY_ADDRESS``, or a local
        cluster started for this executor (and stopped by :meth:`shutdown`). Ignored when Ray is
        already initialized in this process.
      num_cpus: CPUs each actor reserves.
      resources: Custom resources each actor requires, e.g. ``{"scoring": 1}`` for nodes
        started with ``ray start --resources '{"scoring": 4}'``: scoring then never runs on the
        target machine.
      init_kwargs: More ``ray.init`` arguments (``num_cpus`` for a local cluster, ...).

    Tasks go to the actors in turn; an actor that died is replaced (its task fails, and
    ``tune`` retries it elsewhere).
    """

    def __init__(self, num_workers: int | None = None, address: str | None = None, num_cpus: float = 1,
                 resources: Mapping[str, float] | None = None, **init_kwargs: Any):
        ray = _ray()
        if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
            raise ValueError(f"num_workers must be a positive integer or None. Received: num_workers={num_workers!r}")
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address or os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     log_to_driver=False, **init_kwargs)
        if num_workers is None:
            num_workers = max(1, int(ray.cluster_resources().get("CPU", 1) // num_cpus))
        self._options = {"num_cpus": num_cpus, "resources": dict(resources or {}), "max_restarts": 0}
        self._actor_class = ray.remote(_Worker)
        self._actors = [self._start() for _ in range(num_workers)]
        self._turn = itertools.count()
        self._shared: dict[str, _RayWorkloadRef] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _start(self) -> Any:
        return self._actor_class.options(**self._options).remote()

    @property
    def num_workers(self) -> int:
        return len(self._actors)

    def autopolicy_workload(self, ref: Any) -> _RayWorkloadRef:
        """The workload put in the object store once (``search.executor`` calls this)."""
        with self._lock:
            if ref.digest not in self._shared:
                self._shared[ref.digest] = _RayWorkloadRef(ref.digest, _ray().put(ref.load()))
            return self._shared[ref.digest]

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("cannot submit to a RayExecutor after shutdown()")
        with self._lock:
            index = next(self._turn) % len(self._actors)
            actor = self._actors[index]
        inner = actor.run.remote(fn, *args, **kwargs).future()
        # The caller sees a failure only once a dead actor has been replaced: a retry submitted
        # as soon as it sees one must not land on the dead actor again.
        outer: concurrent.futures.Future = concurrent.futures.Future()
        outer.add_done_callback(lambda f: inner.cancel() if f.cancelled() else None)

        def settle(done: concurrent.futures.Future) -> None:
            if done.cancelled():
                outer.cancel()
                return
            error = done.exception()
            if error is not None:
                self._replace_if_dead(index, actor, error)
            if outer.set_running_or_notify_cancel():
                if error is None:
                    outer.set_result(done.result())
                else:
                    outer.set_exception(error)

        inner.add_done_callback(settle)
        return outer

    def _replace_if_dead(self, index: int, actor: Any, error: BaseException) -> None:
        if type(error).__name__ not in ("ActorDiedError", "RayActorError", "ActorUnavailableError"):
            return
        with self._lock:
            if not self._closed and self._actors[index] is actor:
                self._actors[index] = self._start()

    def worker_pids(self) -> list[int]:
        """Each actor's process id (tests kill one)."""
        ray = _ray()
        return ray.get([a.pid.remote() for a in self._actors])

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        ray = _ray()
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._owns_ray:
            ray.shutdown()


def _ignore_interrupts() -> None:
    """A worker process leaves Ctrl-C (sent to the whole process group) to the target, which
    stops the run and the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def running(executor: concurrent.futures.Executor) -> Iterator[concurrent.futures.Executor]:
    """``executor`` for the block, shut down after it: waiting for its workers when the block
    ended normally, cancelling what is queued and not waiting after an error or a Ctrl-C."""
    try:
        yield executor
    except BaseException:
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    executor.shutdown(wait=True)


def make_executor(spec: str, ray_address: str | None = None) -> concurrent.futures.Executor:
    """The executor that ``--executor SPEC`` names (see :data:`EXECUTOR_CHOICES`).

    ``processes:N`` spawns its processes (never forks: JAX is multithreaded); ``ray`` uses
    ``ray_address``, else ``RAY_ADDRESS``, else a local cluster.
    """
    match = re.fullmatch(r"(processes|ray)(?::(\d+))?", spec.strip()) if isinstance(spec, str) else None
    count = int(match.group(2)) if match and match.group(2) else None
    if match is None or (match.group(1) == "processes" and not count) or count == 0:
        raise ValueError(f"--executor must be one of {EXECUTOR_CHOICES}. Received: {spec!r}")
    if match.group(1) == "processes":
        return concurrent.futures.ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn"),
                                                      initializer=_ignore_interrupts)
    return RayExecutor(num_workers=count, address=ray_address)
