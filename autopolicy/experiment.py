"""Experiments: a trained model, its data, how to score it, and a default budget.

An experiment is a Python file that defines ``build(cache_dir) -> Experiment`` (and optionally
``DESCRIPTION``). The built-in ones live in the repository's ``experiments/`` directory; any
file path works too. Trained weights are cached, so only the first run trains.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import sys
from types import ModuleType
from typing import Any, Callable, Sequence

__all__ = ["Experiment", "experiment_dirs", "available", "load", "cached_model", "default_cache_dir"]


@dataclasses.dataclass
class Experiment:
    """Everything ``autopolicy tune`` needs.

    Attributes:
      name: The experiment's name.
      model: The trained (built, float) model.
      eval_fn: ``eval_fn(model) -> float``, higher is better, on validation data.
      sample_input: A realistic input (or tuple of inputs) for timing.
      test_fn: Optional score on held-out test data (reported only).
      calibration_inputs: Batches for float8 calibration and output fidelity.
      max_drop: Default allowed metric drop (relative unless ``relative`` is False).
      relative: Whether ``max_drop`` is a fraction of the float32 metric.
      candidates: Default candidate policies (None: ``autopolicy.search.DEFAULT_CANDIDATES``).
      metric_name: What ``eval_fn`` measures, for reports.
      description: One line for listings and reports.
    """

    name: str
    model: Any
    eval_fn: Callable[[Any], float]
    sample_input: Any
    test_fn: Callable[[Any], float] | None = None
    calibration_inputs: Sequence[Any] | None = None
    max_drop: float = 0.01
    relative: bool = True
    candidates: Sequence[str] | None = None
    metric_name: str = "metric"
    description: str = ""


def default_cache_dir() -> pathlib.Path:
    """``$AUTOPOLICY_CACHE`` or ``~/.cache/autopolicy``: where trained weights are kept."""
    return pathlib.Path(os.environ.get("AUTOPOLICY_CACHE", pathlib.Path.home() / ".cache" / "autopolicy"))


def experiment_dirs() -> list[pathlib.Path]:
    """Where built-in experiments are looked up: ``$AUTOPOLICY_EXPERIMENTS``, the repository's
    ``experiments/`` next to the package, and ``./experiments``."""
    dirs = []
    if os.environ.get("AUTOPOLICY_EXPERIMENTS"):
        dirs.append(pathlib.Path(os.environ["AUTOPOLICY_EXPERIMENTS"]))
    dirs.append(pathlib.Path(__file__).resolve().parent.parent / "experiments")
    dirs.append(pathlib.Path.cwd() / "experiments")
    return [d for i, d in enumerate(dirs) if d.is_dir() and d.resolve() not in [x.resolve() for x in dirs[:i]]]


def available() -> dict[str, pathlib.Path]:
    """Built-in experiments by name (files defining ``build``; benchmarks are not experiments)."""
    found: dict[str, pathlib.Path] = {}
    for directory in experiment_dirs():
        for path in sorted(directory.glob("*.py")):
            if path.stem.startswith(("_", "bench_")) or path.stem in found:
                continue
            if "def build(" in path.read_text(encoding="utf-8"):
                found[path.stem] = path
    return found


def _import(path: pathlib.Path) -> ModuleType:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    name = f"_autopolicy_experiment_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # An experiment may import helpers that sit beside it (``from _digits import ...``).
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(path.parent))
    return module


def load(name_or_path: str) -> ModuleType:
    """The experiment module for a built-in name or a ``.py`` file path.

    Raises:
      ValueError: naming the valid experiments, when there is no such experiment.
    """
    path = pathlib.Path(name_or_path)
    if path.suffix == ".py":
        if not path.is_file():
            raise ValueError(f"No experiment file at {name_or_path!r}")
        module = _import(path)
    else:
        choices = available()
        if name_or_path not in choices:
            raise ValueError(f"Unknown experiment {name_or_path!r}. Expected one of {tuple(choices)} or a .py file.")
        module = _import(choices[name_or_path])
    if not callable(getattr(module, "build", None)):
        raise ValueError(f"{name_or_path!r} does not define build(cache_dir) -> Experiment")
    return module


def cached_model(cache_dir: str | os.PathLike, name: str, train: Callable[[], Any],
                 custom_objects: dict | None = None) -> Any:
    """The model saved under ``cache_dir/name``, or ``train()``'s model (then saved there)."""
    from autopolicy import nn  # pylint: disable=import-outside-toplevel

    directory = pathlib.Path(cache_dir) / name
    if (directory / "model.json").is_file() and (directory / "weights.npz").is_file():
        return nn.load(directory, custom_objects=custom_objects)
    model = train()
    nn.save(model, directory)
    return model
