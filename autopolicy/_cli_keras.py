"""The command line's Keras side: tune a ``.keras`` file, apply a map to one.

Imported by :mod:`autopolicy.cli` only when a ``.keras`` file is named (so the other commands
never import Keras). Bad input raises ``ValueError`` with one clear line.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import sys
from typing import Any, Callable

import numpy as np

__all__ = ["load_callable", "load_sample", "keras_experiment", "apply_map", "is_keras_model"]

_SAMPLE_FORMS = "a .npy file, a .npz file (its arrays in order, as a tuple) or module:function"


def _import(module_name: str) -> Any:
    if module_name.endswith(".py"):
        path = pathlib.Path(module_name)
        if not path.is_file():
            raise ValueError(f"No Python file at {module_name!r}")
        spec = importlib.util.spec_from_file_location(f"_autopolicy_cli_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    sys.path.insert(0, os.getcwd())  # `autopolicy tune ... --eval my_eval:accuracy` from the project dir
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"Cannot import {module_name!r}: {e}") from None
    finally:
        sys.path.remove(os.getcwd())


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """The function named by ``module:function`` or ``path/to/file.py:function``.

    Raises:
      ValueError: for another form, a module that does not import, or a name that is not a
        function of it.
    """
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{what} must be module:function or path/to/file.py:function. Received: {spec!r}")
    fn = getattr(_import(module_name), name, None)
    if not callable(fn):
        raise ValueError(f"{what}: {module_name!r} has no function {name!r}")
    return fn


def load_sample(spec: str) -> Any:
    """A sample input from a ``.npy``/``.npz`` file or a ``module:function`` returning one."""
    if spec.endswith((".npy", ".npz")):
        if not os.path.isfile(spec):
            raise ValueError(f"No sample file at {spec!r}")
        loaded = np.load(spec, allow_pickle=False)
        if spec.endswith(".npy"):
            return loaded
        with loaded:
            return tuple(loaded[k] for k in loaded.files)
    if ":" not in spec:
        raise ValueError(f"--sample must be {_SAMPLE_FORMS}. Received: {spec!r}")
    return load_callable(spec, "--sample")()


def is_keras_model(model: Any) -> bool:
    """Whether ``model`` is a Keras model (checked without importing Keras)."""
    return any(cls.__module__.split(".")[0] == "keras" for cls in type(model).__mro__)


def keras_experiment(path: str, eval_spec: str | None, sample_spec: str | None, test_spec: str | None = None) -> Any:
    """An :class:`~autopolicy.experiment.Experiment` for a ``.keras`` file.

    Raises:
      ValueError: if the file is missing, or ``--eval`` or ``--sample`` is missing or invalid.
    """
    from autopolicy.experiment import Experiment  # pylint: disable=import-outside-toplevel

    if not os.path.isfile(path):
        raise ValueError(f"No Keras model file at {path!r}")
    if not eval_spec or not sample_spec:
        missing = [flag for flag, value in (("--eval", eval_spec), ("--sample", sample_spec)) if not value]
        raise ValueError(f"Tuning a .keras file needs {' and '.join(missing)}: --eval module:function (eval(model) -> "
                         f"float, higher is better unless --lower-is-better) and --sample ({_SAMPLE_FORMS}).")
    import autopolicy.keras as apk  # pylint: disable=import-outside-toplevel

    eval_fn = load_callable(eval_spec, "--eval")
    return Experiment(
        name=pathlib.Path(path).stem, model=apk.load(path), eval_fn=eval_fn, sample_input=load_sample(sample_spec),
        test_fn=load_callable(test_spec, "--test") if test_spec else None,
        metric_name=eval_spec.rpartition(":")[2], description=f"Keras model {path}")


def apply_map(map_file: str, model_file: str, out: str, strict: bool = False, sample_spec: str | None = None) -> str:
    """``autopolicy apply``: the map applied to the model, saved to ``out``; returns a summary line.

    Raises:
      ValueError: for a missing file, an ``out`` that does not end in ``.keras``, or (strict)
        keys that match no layer.
    """
    for name, value in (("map", map_file), ("model", model_file)):
        if not os.path.isfile(value):
            raise ValueError(f"No {name} file at {value!r}")
    if not out.endswith(".keras"):
        raise ValueError(f"--out must end in .keras. Received: {out!r}")
    import autopolicy.keras as apk  # pylint: disable=import-outside-toplevel
    from autopolicy import policies  # pylint: disable=import-outside-toplevel

    policy_map = policies.load_policy_map(map_file)
    calibration = None if sample_spec is None else [load_sample(sample_spec)]
    tuned = apk.apply_policy_map(apk.load(model_file), policy_map, strict=strict, calibration_inputs=calibration)
    apk.save(tuned, out, policy_map)
    changed = sum(1 for layer in tuned._flatten_layers(include_self=False)
                  if layer.path and policy_map.matching_keys(layer.path))
    return f"wrote {out}: {changed} layers set by {len(policy_map)} keys of {map_file}"
