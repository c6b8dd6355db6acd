"""The outcome of a tuning run and the run directory it writes."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

from autopolicy import _atomic, _multihost, policies

__all__ = ["TuneResult", "write_run", "PROFILE_FILE", "FRONTIER_FILE", "MAP_FILE", "SUMMARY_FILE", "KERNELS_FILE",
           "load_run", "write_summary", "kernels_path", "save_kernels", "load_kernels"]

PROFILE_FILE = "profile.csv"
FRONTIER_FILE = "frontier.csv"
MAP_FILE = "policy_map.json"
SUMMARY_FILE = "summary.json"
#: The map's sidecar: the kernel each tuned layer runs (kernels_path(MAP_FILE)).
KERNELS_FILE = "policy_map.kernels.json"
_KERNELS_FORMAT = "autopolicy.kernels/1"


def _json_safe(value: Any) -> Any:
    """NaN/inf become None so the summary is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


@dataclasses.dataclass
class TuneResult:
    """What :func:`autopolicy.search.tune` found, phase by phase.

    Attributes:
      policy_map: The chosen per-layer policies (a ``DTypePolicyMap`` keyed by layer path).
      model: The model with the map applied (float8 scales calibrated), of the user's kind.
      latency: Phase 1, every layer's latency under every candidate (``LatencyProfile``).
      accuracy: Phase 2, every layer's accuracy cost, or why none was measured.
      configurations: Phase 4, every configuration verified or timed end to end (the solved
        maps, then the uniform policies).
      chosen: The winning configuration.
      budget: The float32 metric, its direction and the allowed drop (a rise when lower is better).
      hardware, fingerprint: The machine the figures were measured on.
      candidates: The candidate policy names.
      evaluations: ``eval_fn`` calls by purpose (profile, verify, report_only, total).
      cache_stats: Measurement-cache hits and misses.
      wall_time_s: The run's wall time.
      test: ``test_fn`` of float32 and of the chosen model, when given.
      decisions: How the winner was decided: each challenge, its speed-up with a confidence
        interval and the rounds it took.
      calibration: The latency model's per-policy scales, fitted on the end-to-end timings.
      noise: What the run saw of the machine's load and the timings' spread, and a verdict.
      costs: The tuner's own cost: wall seconds per phase (``phases_s``, see
        :data:`autopolicy.search.costs.PHASES`) and XLA compilations (``compilations``, of which
        ``compile_cache_hits`` were loaded from the persistent compilation cache; ``compile_s``).

    ``profile``, ``frontier`` (DataFrames) and ``summary`` (a JSON-able dict) are derived from
    these; ``save`` writes them.
    """

    policy_map: policies.DTypePolicyMap
    model: Any
    latency: Any  # phases.LatencyProfile
    accuracy: Any  # phases.AccuracyProfile
    configurations: tuple
    chosen: Any  # phases.Configuration
    budget: Any  # phases.Budget
    hardware: dict[str, Any]
    fingerprint: str
    candidates: tuple[str, ...]
    evaluations: dict[str, int]
    cache_stats: dict[str, int]
    wall_time_s: float
    test: dict[str, float] | None = None
    decisions: tuple[str, ...] = ()
    calibration: Any = None  # latency_model.Calibration fitted on every end-to-end timing
    noise: dict[str, Any] | None = None
    costs: dict[str, Any] | None = None
    #: The digest of the float weights the tune started from (``load_tuned(run_dir, model)``
    #: warns when a model's differ), the sample input, and an NNX model's float structure: what
    #: :meth:`save` needs to write the tuned model.
    weights_digest: str | None = None
    sample_args: tuple | None = dataclasses.field(default=None, repr=False)
    structure: Any = dataclasses.field(default=None, repr=False)
    #: A workload's phases (``tune``'s ``workload``): ``{"phase", "weight", "inputs"}`` each, in
    #: order; None for one timed call (the sample input's).
    workload: tuple | None = None

    @functools.cached_property
    def profile(self) -> Any:
        """One row per layer and candidate policy: latency, accuracy cost, fidelity, bytes."""
        from autopolicy.search import _report_tables  # pylint: disable=import-outside-toplevel

        return _report_tables.profile_frame(self.latency, self.accuracy, self.chosen)

    @functools.cached_property
    def frontier(self) -> Any:
        """The predicted latency/accuracy-cost Pareto frontier of per-layer assignments."""
        from autopolicy.search import _report_tables  # pylint: disable=import-outside-toplevel

        return _report_tables.frontier_frame(self.latency, self.accuracy, self.budget, self.configurations)

    @functools.cached_property
    def summary(self) -> dict[str, Any]:
        """Hardware, budget, predicted and measured figures of the map and of each uniform
        policy, evaluation counts, wall time (what ``summary.json`` holds; add keys before
        ``save`` to record more)."""
        from autopolicy.search import _report_tables  # pylint: disable=import-outside-toplevel

        return _report_tables.summary(self)

    @property
    def kernels(self) -> dict[str, str]:
        """``{layer path: kernel}`` of the chosen layers whose mode names a kernel: the kernel each
        runs in :attr:`model` (the end-to-end rounds' choice where they made one), what
        ``policy_map.kernels.json`` holds."""
        rows = self.profile[self.profile["chosen"]]
        return {layer: kernel for layer, kernel in zip(rows["layer"], rows["kernel"])
                if isinstance(kernel, str) and kernel}

    def save(self, run_dir: str | os.PathLike, model: bool = True, tokenizer: Any = None,
             source: dict | None = None) -> str | None:
        """Writes ``profile.csv``, ``frontier.csv``, ``policy_map.json`` (Keras envelope), its
        sidecar ``policy_map.kernels.json`` (:attr:`kernels`) and ``summary.json`` into
        ``run_dir``, each atomically, and (``model``) the tuned model into ``run_dir/tuned``,
        which :func:`autopolicy.load_tuned` reads back (``summary["tuned_model"]`` says its
        framework and bytes). With several JAX processes only process 0 writes (every process
        holds the same result; the others write nothing).

        A language model's ``tokenizer`` (a ``tokenizers.Tokenizer``) and ``source`` (where its
        float weights come from, ``{"gguf": path}``) are saved with it, for ``autopolicy
        generate``.

        Returns:
          The tuned model's directory, or None when none was written (``model=False``, another
          process, or a model of a kind autopolicy cannot save: its map is still written).
        """
        tuned = None
        if model and _multihost.is_writer():
            from autopolicy import _tuned  # pylint: disable=import-outside-toplevel

            tuned = _tuned.save_tuned(self.model, run_dir, self.policy_map, kernels=self.kernels,
                                      device=self.summary.get("device"), weights_digest=self.weights_digest,
                                      sample_args=self.sample_args, structure=self.structure,
                                      tokenizer=tokenizer, source=source)
            if tuned is not None:
                self.summary["tuned_model"] = {"path": _tuned.TUNED_DIR, "framework": _tuned.framework_of(self.model),
                                               "nbytes": _tuned.directory_bytes(tuned)}
        write_run(run_dir, self.policy_map, self.profile, self.frontier, self.summary, self.kernels)
        return tuned


def write_run(run_dir: str | os.PathLike, policy_map: policies.DTypePolicyMap, profile: Any, frontier: Any,
              summary: dict[str, Any], kernels: dict[str, str] | None = None) -> None:
    """Writes a run directory's files, each atomically (``TuneResult.save`` uses it): the map's
    kernel sidecar too when ``kernels`` is given.

    With several JAX processes only process 0 writes (the others hold the same result)."""
    if not _multihost.is_writer():
        return
    os.makedirs(run_dir, exist_ok=True)
    _atomic.write_text(os.path.join(run_dir, PROFILE_FILE), profile.to_csv(index=False))
    _atomic.write_text(os.path.join(run_dir, FRONTIER_FILE), frontier.to_csv(index=False))
    policies.save_policy_map(policy_map, os.path.join(run_dir, MAP_FILE))
    if kernels is not None:
        save_kernels(kernels, os.path.join(run_dir, KERNELS_FILE), summary.get("device"))
    _atomic.write_json(os.path.join(run_dir, SUMMARY_FILE), _json_safe(summary))


def write_summary(run_dir: str | os.PathLike, summary: dict[str, Any]) -> None:
    """Rewrites ``summary.json`` alone, atomically (figures known after :func:`write_run`);
    only process 0 writes."""
    if not _multihost.is_writer():
        return
    _atomic.write_json(os.path.join(run_dir, SUMMARY_FILE), _json_safe(summary))


def load_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Reads a run directory back: ``{"profile", "frontier", "policy_map", "summary"}``.

    Raises:
      FileNotFoundError: if ``run_dir`` or one of its files is missing.
    """
    import pandas as pd  # pylint: disable=import-outside-toplevel

    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"No run directory at {os.fspath(run_dir)!r}")
    with open(os.path.join(run_dir, SUMMARY_FILE), encoding="utf-8") as f:
        summary = json.load(f)
    return {
        "profile": pd.read_csv(os.path.join(run_dir, PROFILE_FILE)),
        "frontier": pd.read_csv(os.path.join(run_dir, FRONTIER_FILE)),
        "policy_map": policies.load_policy_map(os.path.join(run_dir, MAP_FILE)),
        "summary": summary,
    }


def kernels_path(map_path: str | os.PathLike) -> str:
    """The kernel sidecar of a policy map file: ``X.json`` -> ``X.kernels.json``.

    >>> kernels_path("runs/a/policy_map.json")
    'runs/a/policy_map.kernels.json'
    """
    root, ext = os.path.splitext(os.fspath(map_path))
    return f"{root if ext == '.json' else os.fspath(map_path)}.kernels.json"


def save_kernels(kernels: dict[str, str], path: str | os.PathLike, device: str | None = None) -> None:
    """Writes ``{layer path: kernel}`` as a policy map's sidecar (atomically), with the device
    the kernels were chosen on."""
    _atomic.write_json(path, {"format": _KERNELS_FORMAT, "device": device, "kernels": dict(sorted(kernels.items()))})


def load_kernels(path: str | os.PathLike, model: Any = None) -> dict[str, str]:
    """Reads a policy map's kernel sidecar (:func:`save_kernels`): ``{layer path: kernel}``, for
    ``model.with_kernels(...)`` after ``model.with_dtype_policy(policy_map)``.

    With ``model`` (a model under the map with ``layers_by_path()``, as :mod:`autopolicy.nn`'s),
    the kernels this process cannot run (chosen on another machine: ``cpu_ffi`` where the CPU
    kernels are not built, ``cpu_ffi_avx2`` without AVX2) are left out, with one warning naming
    them, as :func:`autopolicy.nn.load` does.

    Raises:
      FileNotFoundError: if there is no file at ``path``.
      ValueError: naming the file, when it is not such a sidecar.
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)!r} is not a kernel sidecar: not JSON ({e})") from None
    kernels = data.get("kernels") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or data.get("format") != _KERNELS_FORMAT or not isinstance(kernels, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in kernels.items())):
        raise ValueError(f"{os.fspath(path)!r} is not a kernel sidecar (expected a JSON object with "
                         f"\"format\": {_KERNELS_FORMAT!r} and \"kernels\": {{layer path: kernel}}).")
    if model is None:
        return dict(kernels)
    from autopolicy.numerics import kernels as kernel_specs  # pylint: disable=import-outside-toplevel

    return kernel_specs.runnable(model.layers_by_path(), kernels, "chosen")
