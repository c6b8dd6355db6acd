"""One-layer accuracy evaluations farmed out to any ``concurrent.futures.Executor``.

Latency is only ever measured on the target (the process that called ``tune``); the accuracy
of a layer under a candidate (the model with that layer switched, scored with ``eval_fn``) does
not depend on where it runs, as long as the numerics are the same. So ``tune(..., executor=...)``
sends those evaluations to an executor: a ``ProcessPoolExecutor`` on this host, Dask's
``Client.get_executor()``, or :class:`autopolicy.distributed.RayExecutor` on a cluster. The
search core imports no engine: it only calls ``submit`` and reads futures.

What is sent:
- a :class:`Workload` once per run: the model, ``eval_fn``, the calibration batches, the
  adapter factory and the kernels chosen on the target, serialized with cloudpickle into a file
  next to the run's cache (``WorkloadRef`` names it; engines with an object store, such as
  :class:`~autopolicy.distributed.RayExecutor`, ship the bytes through it instead). Each worker
  process loads it once and keeps the model, its float32 reference outputs and the compiled
  programs for every later task of the run;
- one small task per (layer, candidate): :func:`score_remote`.

What comes back: the same figures the target computes, plus the worker's numerics fingerprint
(platform, device kind, CPU features, jax/jaxlib, XLA flags, CPU kernel path). A score from a
worker whose fingerprint differs from the target's is a *proxy*: it is used, and marked so in
the profile and the report; the final end-to-end verification always runs on the target.

Failures: a candidate that fails to build or run fails on the worker as it would on the target
(its error comes back as a result and disqualifies it). An infrastructure failure (a worker
that died, a broken pool, a lost actor) is retried once through the executor and then scored on
the target, so a run never stops for it. Every score is cached (and flushed) as it arrives: an
interrupted run loses none, and resumes like any other.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import sys
import tempfile
from typing import Any, Callable, Iterable, Iterator, Sequence

__all__ = ["Workload", "WorkloadRef", "numerics_fingerprint", "score_remote", "scores", "describe_numerics"]

#: The keys of a numerics fingerprint: what can change a model's outputs bit for bit.
NUMERICS_KEYS = ("platform", "device_kind", "cpu_features", "jax", "jaxlib", "xla_flags", "cpu_kernels")


def numerics_fingerprint() -> dict[str, Any]:
    """What this process's numerics depend on (see :data:`NUMERICS_KEYS`)."""
    import jax  # pylint: disable=import-outside-toplevel
    import jaxlib  # pylint: disable=import-outside-toplevel

    from autopolicy.numerics import cpu_kernels  # pylint: disable=import-outside-toplevel
    from autopolicy.search import hardware  # pylint: disable=import-outside-toplevel

    device = jax.devices()[0]
    features = hardware.detect()["cpu"]["features"] if device.platform == "cpu" else []
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "cpu_features": sorted(features),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cpu_kernels": cpu_kernels.path() if cpu_kernels.AVAILABLE else "none",
    }


def describe_numerics(worker: dict[str, Any], target: dict[str, Any]) -> str:
    """How a worker's numerics differ from the target's: ``jaxlib 0.10.1 (target 0.10.2)``.

    >>> describe_numerics({"platform": "gpu", "jax": "1"}, {"platform": "cpu", "jax": "1"})
    'platform gpu (target cpu)'
    """
    return "; ".join(f"{k} {worker.get(k)} (target {target.get(k)})" for k in NUMERICS_KEYS
                     if worker.get(k) != target.get(k))


@dataclasses.dataclass
class Workload:
    """What a worker needs to score a one-layer candidate exactly as the target would."""

    model: Any
    eval_fn: Callable[[Any], float]
    sample_args: tuple
    calibration: list
    adapter_factory: Any  # None: the adapter registered for the model's type
    kernels: Any  # the kernels chosen on the target (adapter.use_kernels), or None

    def dumps(self) -> bytes:
        """The workload as bytes (cloudpickle: closures and the functions of an experiment file
        travel by value)."""
        return dumps_by_value(self, _modules_of(self.eval_fn, self.model, self.adapter_factory))


def dumps_by_value(obj: Any, modules: Iterable[Any]) -> bytes:
    """``cloudpickle.dumps(obj)`` with the classes and functions of those ``modules`` that another
    process cannot import by name (an experiment file loaded from a path) stored by value."""
    import cloudpickle  # pylint: disable=import-outside-toplevel

    unique = {id(m): m for m in modules}.values()
    by_value = [m for m in unique if not _importable(m)]  # each once: cloudpickle counts no registrations
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(obj)
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)


def _modules_of(*objects: Any) -> Iterator[Any]:
    for obj in objects:
        for name in {getattr(obj, "__module__", None), type(obj).__module__}:
            module = sys.modules.get(name) if name else None
            if module is not None:
                yield module


def _importable(module: Any) -> bool:
    """Whether another process can import ``module`` by name (an experiment file loaded from a
    path cannot: its functions must travel by value)."""
    name = module.__name__
    if name in ("__main__", "__mp_main__") or name.startswith("_autopolicy_experiment_") \
            or name.startswith("_autopolicy_cli_"):
        return False
    spec = getattr(module, "__spec__", None)
    return spec is not None and spec.name == name


@dataclasses.dataclass(frozen=True)
class WorkloadRef:
    """A workload by reference: its digest, and the file holding its bytes."""

    digest: str
    path: str

    def load(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()


class _Loaded:
    """A workload made ready in a worker: the adapter, the float32 reference and the scorer."""

    def __init__(self, workload: Workload):
        from autopolicy import policies  # pylint: disable=import-outside-toplevel
        from autopolicy.search._defaults import REFERENCE  # pylint: disable=import-outside-toplevel
        from autopolicy.search.adapter import get_adapter, supports_kernels  # pylint: disable=import-outside-toplevel
        from autopolicy.search.sensitivity import Scorer  # pylint: disable=import-outside-toplevel

        self.adapter = get_adapter(workload.model, workload.sample_args, workload.calibration,
                                   workload.adapter_factory)
        if workload.kernels is not None and supports_kernels(self.adapter):
            self.adapter.use_kernels(workload.kernels)
        reference = self.adapter.with_policies(policies.DTypePolicyMap(REFERENCE))
        self.scorer = Scorer(workload.eval_fn, workload.calibration, self.adapter, reference)
        self.numerics = numerics_fingerprint()


#: Workloads loaded in this process (a worker keeps the last few runs' models).
_LOADED: dict[str, _Loaded] = {}
_KEEP = 2


def _loaded(ref: Any) -> _Loaded:
    if ref.digest not in _LOADED:
        import cloudpickle  # pylint: disable=import-outside-toplevel

        while len(_LOADED) >= _KEEP:
            _LOADED.pop(next(iter(_LOADED)))
        _LOADED[ref.digest] = _Loaded(cloudpickle.loads(ref.load()))
    return _LOADED[ref.digest]


def score(adapter: Any, scorer: Any, path: str, policy_name: str, model: Any = None) -> dict[str, Any]:
    """The figures of ``path`` switched alone to ``policy_name`` (the rest float32): metric,
    SQNR, KL and whether its outputs are finite. The one definition the target and the workers
    share. ``model``: that model, where the caller built it already (:func:`candidate_model`)."""
    if model is None:
        model = candidate_model(adapter, path, policy_name)
    return scorer.score(model, f"{path} as {policy_name}")


def candidate_model(adapter: Any, path: str, policy_name: str) -> Any:
    """The model with the layer at ``path`` alone under ``policy_name``, the rest float32, in the
    form the adapter scores such models in (its optional ``scoring_model``:
    :data:`~autopolicy.search.adapter.SCORING_METHOD`)."""
    from autopolicy import policies  # pylint: disable=import-outside-toplevel
    from autopolicy.search.adapter import SCORING_METHOD  # pylint: disable=import-outside-toplevel

    model = adapter.with_policies(adapter.complete_map({path: policies.get(policy_name)}))
    scoring = getattr(adapter, SCORING_METHOD, None)
    return model if scoring is None else scoring(model)


def score_remote(ref: Any, path: str, policy_name: str) -> dict[str, Any]:
    """The task a worker runs: :func:`score` on its copy of the workload, with its numerics
    fingerprint. A candidate that fails to build or run comes back as ``{"error": ...}``;
    failures of the worker itself (the workload cannot be loaded) raise."""
    loaded = _loaded(ref)
    try:
        figures, evaluations = score(loaded.adapter, loaded.scorer, path, policy_name), 1
    except Exception as e:  # pylint: disable=broad-except
        figures, evaluations = {"error": f"{type(e).__name__}: {str(e)[:200]}"}, 0
    return {**figures, "numerics": loaded.numerics, "evaluations": evaluations,
            "worker": f"{os.uname().nodename}:{os.getpid()}"}


def share(workload: Workload, directory: str | None) -> tuple[WorkloadRef, Callable[[], None]]:
    """Writes the workload's bytes for the workers; (its reference, a function that removes the
    file when the run is done). ``directory``: the run's cache directory, or None (a temporary
    one)."""
    from autopolicy import _atomic  # pylint: disable=import-outside-toplevel

    blob = workload.dumps()
    digest = hashlib.sha256(blob).hexdigest()[:16]
    temporary = directory is None
    directory = tempfile.mkdtemp(prefix="autopolicy-workload-") if temporary else directory
    path = os.path.join(directory, f"workload-{digest}.pkl")
    _atomic.write_bytes(path, blob)

    def remove() -> None:
        for target in ([path] + ([directory] if temporary else [])):
            try:
                (os.rmdir if target == directory else os.remove)(target)
            except OSError:
                pass

    return WorkloadRef(digest, os.path.abspath(path)), remove


def _submit(executor: concurrent.futures.Executor, ref: WorkloadRef, task: tuple[str, str]) -> Any:
    prepare = getattr(executor, "autopolicy_workload", None)  # an engine that ships bytes its own way
    return executor.submit(score_remote, prepare(ref) if prepare else ref, *task)


def scores(executor: concurrent.futures.Executor, ref: WorkloadRef, tasks: Sequence[tuple[str, str]],
           local: Callable[[str, str], dict[str, Any]], retries: int = 1
           ) -> Iterable[tuple[tuple[str, str], dict[str, Any] | None, str]]:
    """Scores ``tasks`` ((path, policy name) pairs) on ``executor``; yields (task, figures,
    where) as each finishes, in completion order: ``where`` is ``"worker"`` or ``"target"``.

    A task whose worker failed (not the candidate: the process, the pool, the actor) is
    submitted again up to ``retries`` times, then run on the target by ``local(path, policy)``,
    which returns the figures itself (or None when the candidate failed there too)."""
    pending: dict[Any, tuple[tuple[str, str], int]] = {}
    fallback: list[tuple[str, str]] = []

    def submit(task: tuple[str, str], attempt: int) -> None:
        try:
            pending[_submit(executor, ref, task)] = (task, attempt)
        except Exception:  # pylint: disable=broad-except  # a broken or shut-down executor
            fallback.append(task)

    for task in tasks:
        submit(task, 0)
    try:
        while pending:
            done, _ = concurrent.futures.wait(list(pending), return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                task, attempt = pending.pop(future)
                try:
                    figures = future.result()
                except Exception:  # pylint: disable=broad-except  # the worker, not the candidate
                    if attempt < retries:
                        submit(task, attempt + 1)
                    else:
                        fallback.append(task)
                    continue
                yield task, figures, "worker"
    finally:
        for future in pending:  # interrupted: nothing more is waited for
            future.cancel()
    for task in fallback:
        yield task, local(*task), "target"
