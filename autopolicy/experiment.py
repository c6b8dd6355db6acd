"""Experiments: a trained model, its data, how to score it, and a default budget.

An experiment is a Python file that defines ``build(cache_dir) -> Experiment`` (and optionally
``DESCRIPTION``). The built-in ones live in the repository's ``experiments/`` directory; any
file path works too. Trained weights are cached, so only the first run trains.

Keyword parameters of ``build`` with defaults are the experiment's options
(``build(cache_dir, small: bool = False, batch: Literal[1, 16, 64] = 1)``):
``autopolicy tune NAME --small --option batch=16`` and ``build(module, small=True, batch=16)``
pass them, checked first, and the experiment built is another form of it, named for the options
that differ from their defaults (``decoder_1b-small-batch16``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import sys
import warnings
from types import ModuleType
from typing import Any, Callable, Sequence

from autopolicy import _experiment_options

__all__ = ["Experiment", "Option", "experiment_dirs", "available", "load", "build", "options_of", "form_suffix",
           "cached_model", "default_cache_dir"]


@dataclasses.dataclass
class Experiment:
    """Everything ``autopolicy tune`` needs.

    Attributes:
      name: The experiment's name.
      model: The trained (built, float) model.
      eval_fn: ``eval_fn(model) -> float`` on validation data, in the direction
        ``higher_is_better`` says.
      sample_input: A realistic input (or tuple of inputs) for timing.
      test_fn: Optional score on held-out test data (reported only).
      calibration_inputs: Batches for float8 calibration and output fidelity.
      max_drop: Default allowed worsening of the metric: a drop, or a rise when
        ``higher_is_better`` is False (relative unless ``relative`` is False).
      relative: Whether ``max_drop`` is a fraction of the float32 metric.
      higher_is_better: The metric's direction: False for perplexity or loss.
      candidates: Default candidate policies (None: ``autopolicy.search.DEFAULT_CANDIDATES``).
      metric_name: What ``eval_fn`` measures, for reports.
      description: One line for listings and reports.
      loss_fn: Optional ``loss_fn(model, *batch)`` -> per-example losses on a calibration batch
        (differentiable): ``tune``'s first-order accuracy estimate.
      loss_link: How a change of that loss reads as a change of the metric (``tune``'s
        ``loss_link``: ``"exp"`` for a perplexity, ``"loss"``, ``"fitted"``).
      loss_inputs: The batches ``loss_fn`` runs on (None: the calibration batches).
      step_carry: For a stateful objective (a decode step): ``step_carry(sample_args, outputs)``
        gives the next step's arguments (``tune``'s ``step_carry``). None: a stateless call.
      tokenizer: A language model's ``tokenizers.Tokenizer``: saved with the tuned model, so that
        ``autopolicy generate RUN_DIR`` turns text into tokens and back.
      source: Where the float model comes from, as JSON (``{"gguf": "/path/model.gguf"}``):
        recorded with the tuned model, so that ``autopolicy generate --float32`` can load the
        float reference.
      workload_fn: For ``autopolicy tune --workload``: ``workload_fn(requests)`` -> the phases
        (:class:`autopolicy.search.Phase`) of those generation requests
        (:class:`autopolicy.search.Request`), e.g. ``lambda requests:
        generation.workload_phases(model, requests)``. None: the experiment takes no workload.
      options: The options it was built with, every option of its ``build`` with its value
        (:func:`build` sets it; ``{}`` for an experiment without options).
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
    higher_is_better: bool = True
    metric_name: str = "metric"
    description: str = ""
    loss_fn: Callable[..., Any] | None = None
    loss_link: str = "fitted"
    loss_inputs: Sequence[Any] | None = None
    step_carry: Callable[[tuple, Any], tuple] | None = None
    tokenizer: Any = None
    source: dict | None = None
    workload_fn: Callable[[Sequence[Any]], Sequence[Any]] | None = None
    options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Experiment.name must be a non-empty str. Received: name={self.name!r}")
        if self.model is None:
            raise ValueError(f"Experiment {self.name!r} has no model (model=None).")
        for field in ("eval_fn", "test_fn"):
            value = getattr(self, field)
            if not callable(value) and not (field == "test_fn" and value is None):
                raise TypeError(f"Experiment.{field} must be a function of the model. Received: {field}={value!r}")
        if self.sample_input is None:
            raise ValueError(f"Experiment {self.name!r} has no sample_input (sample_input=None).")
        if isinstance(self.max_drop, bool) or not isinstance(self.max_drop, (int, float)) or not self.max_drop >= 0:
            raise ValueError(f"Experiment.max_drop must be a number >= 0. Received: max_drop={self.max_drop!r}")
        if not isinstance(self.relative, bool):
            raise TypeError(f"Experiment.relative must be True or False. Received: relative={self.relative!r}")
        if not isinstance(self.higher_is_better, bool):
            raise TypeError(f"Experiment.higher_is_better must be True (accuracy) or False (perplexity, loss). "
                            f"Received: higher_is_better={self.higher_is_better!r}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(f"Experiment.loss_fn must be a function loss_fn(model, *batch), or None. "
                            f"Received: loss_fn={self.loss_fn!r}")
        links = ("exp", "loss", "fitted")  # autopolicy.search.first_order.LINKS (not imported: no jax here)
        if self.loss_link not in links:
            raise ValueError(f"Experiment.loss_link must be one of {list(links)}. Received: loss_link={self.loss_link!r}")
        if self.tokenizer is not None and not callable(getattr(self.tokenizer, "to_str", None)):
            raise TypeError(f"Experiment.tokenizer must be a tokenizers.Tokenizer (it is saved with to_str()). "
                            f"Received: tokenizer={type(self.tokenizer).__name__}")
        if self.source is not None and not isinstance(self.source, dict):
            raise TypeError(f"Experiment.source must be a dict such as {{'gguf': path}}. Received: source={self.source!r}")
        if not isinstance(self.options, dict):
            raise TypeError(f"Experiment.options must be a dict such as {{'batch': 16}}. "
                            f"Received: options={self.options!r}")
        if self.workload_fn is not None and not callable(self.workload_fn):
            raise TypeError(f"Experiment.workload_fn must be a function of the requests, or None. "
                            f"Received: workload_fn={self.workload_fn!r}")
        if isinstance(self.candidates, str):
            raise TypeError(f"Experiment.candidates must be a sequence of policy names, not one str. "
                            f"Received: candidates={self.candidates!r}; write ({self.candidates!r},)")


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
    """Built-in experiments by name: the files defining ``build`` (a leading underscore marks a
    private helper; the benchmarks live in the repository's ``benchmarks/``, not here)."""
    found: dict[str, pathlib.Path] = {}
    for directory in experiment_dirs():
        for path in sorted(directory.glob("*.py")):
            if path.stem.startswith("_") or path.stem in found:
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
    except (Exception, SystemExit) as e:  # pylint: disable=broad-except
        del sys.modules[name]
        raise ValueError(f"The experiment file {str(path)!r} failed to import: {_describe(e)}") from e
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(path.parent))
    return module


def _describe(error: BaseException) -> str:
    """``SyntaxError: invalid syntax (tiny.py, line 3)``: the error's kind and first line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def load(name_or_path: str | os.PathLike) -> ModuleType:
    """The experiment module for a built-in name or a ``.py`` file path.

    Raises:
      TypeError: if ``name_or_path`` is not a str or os.PathLike.
      ValueError: naming the valid experiments, when there is no such experiment; naming the
        file and the error, when the file fails to import (a SyntaxError, an exception).
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"An experiment is a name or a .py path. Received: {name_or_path!r}")
    name_or_path = os.fspath(name_or_path)
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


def build(module: ModuleType, cache_dir: str | os.PathLike | None = None, **options: Any) -> Experiment:
    """Calls the experiment module's ``build(cache_dir, **options)`` and checks what it returns.

    Args:
      module: From :func:`load`.
      cache_dir: Where trained weights are cached (default: :func:`default_cache_dir`).
      **options: The experiment's options (:func:`options_of`), checked before it is built.
        The experiment returned is named for the options that differ from their defaults
        (:func:`form_suffix`: ``decoder_1b-small-batch16``), and its ``options`` are every
        option's value.

    Raises:
      ValueError: for an option the experiment does not take or a bad value, naming the valid
        ones; naming the experiment and the error, when ``build`` raises (file system errors,
        OSError, are raised as they are).
      TypeError: when it returns something other than an :class:`Experiment`.
    """
    where = getattr(module, "__file__", None) or getattr(module, "__name__", repr(module))
    given = _experiment_options.resolve(module.build, options, _name_of(module))
    try:
        made = module.build(default_cache_dir() if cache_dir is None else cache_dir, **given)
    except OSError:
        raise
    except (Exception, SystemExit) as e:  # pylint: disable=broad-except
        raise ValueError(f"build() of the experiment {str(where)!r} failed: {_describe(e)}") from e
    if not isinstance(made, Experiment):
        raise TypeError(
            f"build() of the experiment {str(where)!r} must return an autopolicy.experiment.Experiment. "
            f"It returned {type(made).__name__} {str(made)[:60]!r}."
        )
    known = _experiment_options.declared(module.build)
    values = dict(given) if known is None else {n: given.get(n, o.default) for n, o in known.items()}
    return dataclasses.replace(made, name=made.name + _experiment_options.suffix(given, known), options=values)


def _name_of(module: ModuleType) -> str:
    """The experiment's name in messages: its file's stem (``decoder_1b``)."""
    where = getattr(module, "__file__", None)
    return pathlib.Path(where).stem if where else getattr(module, "__name__", repr(module))


#: One option of an experiment (a keyword parameter of its ``build``): name, default, choices.
Option = _experiment_options.Option


def options_of(module: ModuleType) -> dict[str, Option]:
    """The options the experiment module's ``build`` takes, by name: its keyword parameters with
    defaults, each with its choices where a ``typing.Literal`` annotation lists them (``{}``: none;
    a ``build(cache_dir, **options)`` takes any and gives ``{}`` too)."""
    return _experiment_options.declared(module.build) or {}


def form_suffix(module: ModuleType, **options: Any) -> str:
    """What :func:`build` appends to the experiment's name for these options (``""`` for the
    defaults): ``-small-batch16``. ``autopolicy tune`` names its default run directory so.

    Raises:
      ValueError: as :func:`build`, for an option the experiment does not take or a bad value.
    """
    given = _experiment_options.resolve(module.build, options, _name_of(module))
    return _experiment_options.suffix(given, _experiment_options.declared(module.build))


#: Temporary files older than this in an experiment cache belong to killed runs.
_ORPHAN_AGE_S = 600.0


def cached_model(cache_dir: str | os.PathLike, name: str, train: Callable[[], Any],
                 custom_objects: dict | None = None) -> Any:
    """The model saved under ``cache_dir/name``, or ``train()``'s model (then saved there).

    A damaged save (a truncated ``weights.npz``, a garbled ``model.json``) is trained again,
    with a warning naming it, rather than failing every later run.
    """
    from autopolicy import _atomic, nn  # pylint: disable=import-outside-toplevel
    from autopolicy.nn import serialization  # pylint: disable=import-outside-toplevel

    directory = pathlib.Path(cache_dir) / name
    _atomic.remove_orphans(directory, older_than=_ORPHAN_AGE_S)
    if (directory / "model.json").is_file() or (directory / "weights.npz").is_file():
        try:
            return nn.load(directory, custom_objects=custom_objects)
        except serialization.DamagedSaveError as e:
            warnings.warn(f"The cached model {str(directory)!r} is damaged ({e.detail}); training it again.",
                          UserWarning, stacklevel=2)
        except FileNotFoundError:
            warnings.warn(f"The cached model {str(directory)!r} is incomplete; training it again.", UserWarning,
                          stacklevel=2)
    model = train()
    nn.save(model, directory)
    return model
