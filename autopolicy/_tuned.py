"""The tuned model in a run directory: written by ``TuneResult.save``, read by :func:`load_tuned`.

``RUN_DIR/tuned/`` holds the model exactly as the tune chose and scored it, in its framework's own
format, so that another process uses it with no calibration data and no experiment file:

- an ``autopolicy.nn`` model (``LlamaDecoder`` included): :func:`autopolicy.nn.save`'s
  ``model.json`` and ``weights.npz``, with every layer's policy, the kernels the tune chose, the
  GPTQ/AWQ weights as the tune calibrated them and the float8 scales;
- a Keras model: ``model.keras`` (:func:`autopolicy.keras.save`: Keras's archive plus the map);
- a Flax NNX model: ``state/`` (Orbax), the map and Qwix rules (``autopolicy.flax.save``) and
  ``graphdef.pkl``, the float model's structure (cloudpickle), from which it is rebuilt.

A language model's tokenizer is saved beside as ``tokenizer.json`` (``autopolicy generate``).
``tuned.json`` says which, with the kernels chosen, the device they were chosen on, the digest
of the float weights the tune started from, the layers whose weights came out of a calibration
and the bytes on disk. The directory is written beside and moved into place, so a killed save
leaves the previous one or none, never half of one.

Loading ``graphdef.pkl`` unpickles it: load only the run directories you trust, as with any
pickle (the ``autopolicy.nn`` and Keras forms hold no pickle).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import warnings
from typing import Any

from autopolicy import _atomic, _json, policies

__all__ = ["TUNED_DIR", "MANIFEST", "FORMAT", "save_tuned", "load_tuned", "framework_of", "tuned_path",
           "read_manifest", "export_tuned", "directory_bytes", "TunedModelError"]

TUNED_DIR = "tuned"
MANIFEST = "tuned.json"
FORMAT = "autopolicy.tuned/1"
FRAMEWORKS = ("autopolicy.nn", "keras", "flax")
_KERAS_FILE = "model.keras"
_GRAPHDEF_FILE = "graphdef.pkl"
TOKENIZER_FILE = "tokenizer.json"


class TunedModelError(ValueError):
    """A run directory holds no tuned model this process can load, or a model does not match it."""


def framework_of(model: Any) -> str | None:
    """``"autopolicy.nn"``, ``"keras"`` or ``"flax"`` for a model autopolicy can save; None else.

    >>> from autopolicy import nn
    >>> framework_of(nn.Dense(2)), framework_of(object())
    ('autopolicy.nn', None)
    """
    modules = [cls.__module__.split(".")[0] for cls in type(model).__mro__ if cls is not object]
    from autopolicy.nn._module import Module  # pylint: disable=import-outside-toplevel

    if isinstance(model, Module):
        return "autopolicy.nn"
    if "keras" in modules:
        return "keras"
    if "flax" in modules:
        return "flax"
    return None


def tuned_path(run_dir: str | os.PathLike) -> str:
    """``RUN_DIR/tuned``."""
    return os.path.join(os.fspath(run_dir), TUNED_DIR)


def directory_bytes(path: str | os.PathLike) -> int:
    """The bytes of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def _float_digest(model: Any, framework: str) -> str:
    """The digest of ``model``'s float weights, as the tune's adapter computes it."""
    from autopolicy.search.adapter import digest_arrays  # pylint: disable=import-outside-toplevel

    if framework == "autopolicy.nn":
        return digest_arrays(model.with_dtype_policy(policies.DEFAULT_POLICY_NAME))
    if framework == "keras":
        from autopolicy.adapters._keras_layers import values  # pylint: disable=import-outside-toplevel

        return digest_arrays(values(model))
    from flax import nnx  # pylint: disable=import-outside-toplevel

    return digest_arrays(nnx.state(model))


def _calibrated_paths(policy_map: policies.DTypePolicyMap) -> list[str]:
    """The map's layers whose weights or scales a calibration made (GPTQ, AWQ, float8)."""
    out = []
    for path, policy in policy_map.items():
        mode = policy.quantization_mode
        if mode is not None and (mode == "float8" or policies.get_quantization_mode(mode).calibrated):
            out.append(path)
    return sorted(out)


def _input_spec(args: tuple) -> list:
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel

    return [jax.tree_util.tree_map(lambda x: {"shape": list(np.shape(x)), "dtype": np.asarray(x).dtype.name
                                               if not hasattr(x, "dtype") else str(x.dtype)}, a) for a in args]


def _zeros_of(spec: Any) -> Any:
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    if isinstance(spec, dict) and set(spec) == {"shape", "dtype"}:
        return jnp.zeros(spec["shape"], jnp.dtype(spec["dtype"]))
    if isinstance(spec, list):
        return [_zeros_of(s) for s in spec]
    if isinstance(spec, dict):
        return {k: _zeros_of(v) for k, v in spec.items()}
    return spec


def save_tuned(model: Any, run_dir: str | os.PathLike, policy_map: policies.DTypePolicyMap, *,
               kernels: dict[str, str] | None = None, device: str | None = None,
               weights_digest: str | None = None, sample_args: tuple | None = None,
               structure: Any = None, tokenizer: Any = None, source: dict | None = None) -> str | None:
    """Writes ``model`` (a tune's ``result.model``) into ``RUN_DIR/tuned``; returns that path, or
    None for a model of a kind autopolicy cannot save (a custom adapter's: its map still is).

    ``structure`` is an NNX model's float ``(graphdef, abstract state)``, from which it is rebuilt
    (the Flax adapter's ``float_structure()``); ``sample_args`` the inputs Qwix quantizes it on.

    Raises:
      ValueError: from the framework's own save (a layer with no JSON form, say).
    """
    framework = framework_of(model)
    if framework is None:
        return None
    run_dir = _json.check_path(run_dir, "run_dir")
    os.makedirs(run_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=_atomic.TMP_PREFIX + "tuned-", dir=run_dir)
    try:
        files = _write_model(model, framework, staging, policy_map, sample_args, structure)
        if tokenizer is not None:
            _atomic.write_text(os.path.join(staging, TOKENIZER_FILE), tokenizer.to_str())
            files.append(TOKENIZER_FILE)
        manifest = {"format": FORMAT, "framework": framework, "files": files, "device": device,
                    "kernels": dict(sorted((kernels or {}).items())), "weights_digest": weights_digest,
                    "calibrated": _calibrated_paths(policy_map),
                    "sample": _input_spec(sample_args) if sample_args is not None else None,
                    "source": source,
                    "nbytes": directory_bytes(staging)}
        _atomic.write_json(os.path.join(staging, MANIFEST), manifest)
        target = tuned_path(run_dir)
        if os.path.isdir(target):  # the previous one goes only once the new one is whole
            old = tempfile.mkdtemp(prefix=_atomic.TMP_PREFIX + "old-", dir=run_dir)
            os.replace(target, os.path.join(old, TUNED_DIR))
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_model(model: Any, framework: str, directory: str, policy_map: Any, sample_args: tuple | None,
                 structure: Any) -> list:
    if framework == "autopolicy.nn":
        from autopolicy.nn import serialization  # pylint: disable=import-outside-toplevel

        serialization.save(model, directory)
        return [serialization.MODEL_FILE, serialization.WEIGHTS_FILE]
    if framework == "keras":
        import autopolicy.keras as apk  # pylint: disable=import-outside-toplevel

        apk.save(model, os.path.join(directory, _KERAS_FILE), policy_map)
        return [_KERAS_FILE]
    return _write_flax(model, directory, policy_map, sample_args, structure)


def _write_flax(model: Any, directory: str, policy_map: Any, sample_args: tuple | None, structure: Any) -> list:
    from autopolicy.adapters import _flax_save  # pylint: disable=import-outside-toplevel
    from autopolicy.search import executor  # pylint: disable=import-outside-toplevel

    if sample_args is None or structure is None:
        raise ValueError("Saving a tuned NNX model needs its float structure and sample input (it is rebuilt from "
                         "the float model, which Qwix quantizes by calling it once): pass structure= and "
                         "sample_args=.")
    _flax_save.save(model, directory, policy_map)
    # A class from a file run as a script (an experiment) travels by value; the rest by name.
    modules = [sys.modules[n] for n in _class_modules(structure[0]) if n in sys.modules]
    _atomic.write_bytes(os.path.join(directory, _GRAPHDEF_FILE), executor.dumps_by_value(tuple(structure), modules))
    return [_flax_save.STATE_DIR, _flax_save.MAP_FILE, _flax_save.RULES_FILE, _GRAPHDEF_FILE]


def _class_modules(graphdef: Any) -> set[str]:
    """The module names of the classes in an NNX ``graphdef``."""
    return {node.type.__module__ for node in getattr(graphdef, "nodes", ()) or ()
            if isinstance(getattr(node, "type", None), type)}


def read_manifest(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``RUN_DIR/tuned/tuned.json``, checked.

    Raises:
      FileNotFoundError: naming the directory, when it is not a run directory.
      TunedModelError: when the run holds no tuned model, or one of an unknown format.
    """
    run_dir = _json.check_path(run_dir, "run_dir")
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"No run directory at {run_dir!r}")
    path = os.path.join(tuned_path(run_dir), MANIFEST)
    if not os.path.isfile(path):
        has_map = os.path.isfile(os.path.join(run_dir, "policy_map.json"))
        why = ("it was tuned by an autopolicy that did not save the model, or for a model kind autopolicy cannot "
               "save: run the tune again (it resumes from its cache) or apply its policy_map.json to your model"
               if has_map else "it is not a tune's run directory (no policy_map.json either)")
        raise TunedModelError(f"{run_dir!r} holds no tuned model ({TUNED_DIR}/{MANIFEST} is missing): {why}.")
    with open(path, encoding="utf-8") as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as e:
            raise TunedModelError(f"{path!r} is damaged: not JSON ({e}). Run the tune again to rewrite it.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TunedModelError(f"{path!r} is not a tuned model of format {FORMAT!r}. "
                              f"Received format: {manifest.get('format') if isinstance(manifest, dict) else None!r}")
    if manifest.get("framework") not in FRAMEWORKS:
        raise TunedModelError(f"{path!r} names an unknown framework {manifest.get('framework')!r}. Expected one of "
                              f"{FRAMEWORKS}.")
    return manifest


def load_tuned(run_dir: str | os.PathLike, model: Any = None) -> Any:
    """The tuned model of a run directory (what ``autopolicy tune`` or ``result.save`` wrote).

    Without ``model``, the model exactly as the tune chose it: its outputs are those of the tune's
    ``result.model``. With ``model`` (your own float model of the same architecture), the run's
    choice applied to it: every layer under the run's policy and kernel, quantized from your
    weights, except the layers whose weights or scales came out of the tune's calibration (GPTQ,
    AWQ, float8), which take the stored ones (one warning when your weights differ from those
    the run tuned). Your model itself is not modified.

    Kernels chosen on another machine that this one cannot run fall back to the default, with
    one warning naming them (as :func:`autopolicy.nn.load` does).

    Args:
      run_dir: A run directory.
      model: Optional float model (``autopolicy.nn``, Keras or Flax NNX) of the run's architecture.

    Returns:
      A model of the run's framework.

    Raises:
      FileNotFoundError: if ``run_dir`` does not exist.
      TunedModelError: (a ValueError) if the run holds no tuned model, or ``model`` is of another
        framework or architecture (the first difference named).

    >>> import tempfile
    >>> load_tuned(tempfile.mkdtemp())
    Traceback (most recent call last):
    ...
    autopolicy._tuned.TunedModelError: '...' holds no tuned model (tuned/tuned.json is missing): it is not a tune's run directory (no policy_map.json either).
    """
    manifest = read_manifest(run_dir)
    directory = tuned_path(run_dir)
    framework = manifest["framework"]
    if model is not None and framework_of(model) != framework:
        raise TunedModelError(f"The run tuned a {framework} model; model is a {type(model).__module__}."
                              f"{type(model).__qualname__} ({framework_of(model) or 'no framework autopolicy tunes'}).")
    if framework == "autopolicy.nn":
        from autopolicy import _tuned_nn  # pylint: disable=import-outside-toplevel

        return _tuned_nn.load(directory, manifest, model)
    if framework == "keras":
        from autopolicy import _tuned_keras  # pylint: disable=import-outside-toplevel

        return _tuned_keras.load(directory, manifest, model)
    return _load_flax(directory, manifest, model)


def _load_flax(directory: str, manifest: dict, model: Any) -> Any:
    import pickle  # pylint: disable=import-outside-toplevel

    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from flax import nnx  # pylint: disable=import-outside-toplevel

    from autopolicy.adapters import _flax_save, flax as adapter  # pylint: disable=import-outside-toplevel

    sample = tuple(_zeros_of(manifest["sample"]))
    if model is None:
        with open(os.path.join(directory, _GRAPHDEF_FILE), "rb") as f:
            graphdef, abstract = pickle.load(f)  # noqa: S301  (the module docstring: trusted run directories)

        def placeholder(s: Any) -> Any:
            if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
                return jax.random.split(jax.random.key(0), s.shape) if s.shape else jax.random.key(0)
            return jnp.zeros(s.shape, s.dtype)

        build = lambda: nnx.merge(graphdef, jax.tree_util.tree_map(placeholder, abstract))  # noqa: E731
        return _flax_save.load(directory, build, *sample)
    _check_flax_architecture(model, directory, manifest)
    policy_map = policies.load_policy_map(os.path.join(directory, _flax_save.MAP_FILE))
    _warn_if_other_weights(model, "flax", manifest, manifest.get("calibrated", []))
    return adapter.apply_policy_map(adapter.detached(model), dict(policy_map.items()), *sample)


def _check_flax_architecture(model: Any, directory: str, manifest: dict) -> None:
    import pickle  # pylint: disable=import-outside-toplevel

    import jax  # pylint: disable=import-outside-toplevel
    from flax import nnx  # pylint: disable=import-outside-toplevel

    with open(os.path.join(directory, _GRAPHDEF_FILE), "rb") as f:
        _, abstract = pickle.load(f)  # noqa: S301
    want = {jax.tree_util.keystr(p): tuple(s.shape) for p, s in jax.tree_util.tree_leaves_with_path(abstract)}
    have = {jax.tree_util.keystr(p): tuple(a.shape)
            for p, a in jax.tree_util.tree_leaves_with_path(nnx.state(model))}
    check_same(want, have, "weight")


def check_same(want: dict[str, Any], have: dict[str, Any], what: str) -> None:
    """Raises :class:`TunedModelError` naming the first difference between the run's
    ``{path: description}`` and the model's.

    >>> check_same({"a": (2, 3)}, {"a": (2, 4)}, "weight")
    Traceback (most recent call last):
    ...
    autopolicy._tuned.TunedModelError: model does not match the run's architecture: weight 'a' is (2, 4) in model, (2, 3) in the run.
    """
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing:
        raise TunedModelError(f"model does not match the run's architecture: it lacks the {what}s {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''} of the tuned model.")
    if extra:
        raise TunedModelError(f"model does not match the run's architecture: its {what}s {extra[:5]}"
                              f"{' ...' if len(extra) > 5 else ''} are not in the tuned model.")
    for key in want:
        if want[key] != have[key]:
            raise TunedModelError(f"model does not match the run's architecture: {what} {key!r} is {have[key]} in "
                                  f"model, {want[key]} in the run.")


def _warn_if_other_weights(model: Any, framework: str, manifest: dict, calibrated: list) -> None:
    digest = manifest.get("weights_digest")
    if digest is None or _float_digest(model, framework) == digest:
        return
    taken = (f" The calibrated layers {calibrated} take the run's stored weights and scales." if calibrated else "")
    warnings.warn(f"model's weights differ from those the run tuned: its layers are quantized from your weights, "
                  f"but the accuracy the run measured was measured on the run's.{taken}", stacklevel=3)


def export_tuned(run_dir: str | os.PathLike, out: str | os.PathLike) -> int:
    """Copies a run's tuned model (``RUN_DIR/tuned``) to the directory ``out``, which
    :func:`load_tuned` then reads as a run directory; returns the bytes written.

    Raises:
      TunedModelError: if the run holds no tuned model.
      ValueError: if ``out`` exists and is not an empty directory.
    """
    read_manifest(run_dir)
    out = _json.check_path(out, "--model")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--model {out!r} exists and is not an empty directory: name a new directory.")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=_atomic.TMP_PREFIX + "export-", dir=parent)
    try:
        shutil.copytree(tuned_path(run_dir), os.path.join(staging, TUNED_DIR))
        for name in ("policy_map.json", "policy_map.kernels.json", "summary.json"):
            source = os.path.join(os.fspath(run_dir), name)
            if os.path.isfile(source):
                shutil.copy2(source, os.path.join(staging, name))
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory_bytes(out)
