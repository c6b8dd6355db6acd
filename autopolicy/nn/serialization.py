"""Saving and loading models: architecture and policies as JSON, weights as ``.npz``.

No pickle anywhere: the architecture is rebuilt from the recorded constructor arguments of
registered layer classes, the policies from Keras-envelope JSON, and the arrays are read with
``allow_pickle=False``.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (bfloat16/float8 dtype names)
import numpy as np

from autopolicy import _atomic, _json, policies
from autopolicy.numerics import kernels as kernels_mod
from autopolicy.nn import _config, weight_calibration
from autopolicy.nn._module import Module


__all__ = ["save", "load", "register_serializable", "DamagedSaveError"]

FORMAT = "autopolicy.nn/2"
#: Formats ``load`` reads: /1 packed int4 weights as split halves (row i with row i + ceil(K/2)),
#: repacked to /2's consecutive rows (Keras's layout) when loaded.
READABLE_FORMATS = ("autopolicy.nn/1", FORMAT)
MODEL_FILE = "model.json"
WEIGHTS_FILE = "weights.npz"


def register_serializable(cls: type) -> type:
    """Class decorator: lets :func:`load` rebuild your own Module subclass by name."""
    if not (isinstance(cls, type) and issubclass(cls, Module)):
        raise TypeError(f"register_serializable takes a Module subclass. Received: {cls!r}")
    return _config.register(cls)


def _policy_map(model: Module) -> policies.DTypePolicyMap:
    """Every module's policy by exact path (exact keys win over any regex reading of them)."""
    return policies.DTypePolicyMap(
        policies.DEFAULT_POLICY_NAME, {path: m.dtype_policy for path, m in model.modules().items()}
    )


def _storable(x: jax.Array) -> tuple[np.ndarray, str]:
    arr = np.asarray(x)
    name = arr.dtype.name
    if arr.dtype.kind == "V":  # ml_dtypes (bfloat16, float8): store the raw bits
        arr = arr.view(np.dtype(f"uint{8 * arr.dtype.itemsize}"))
    return arr, name


def save(model: Module, directory: str | os.PathLike) -> None:
    """Writes ``model`` (built; float, quantized or float8) to ``directory``.

    Files: ``model.json`` (constructor arguments, build input shapes, the policy of every layer
    as a Keras ``DTypePolicyMap``, the kernels chosen by ``with_kernels``, array dtypes, the
    paths of calibrated GPTQ/AWQ layers) and
    ``weights.npz``; each written atomically.

    Raises:
      ValueError: if the model is not built or a constructor argument has no JSON form (a
        lambda activation: use a name such as ``"relu"``).
    """
    if not isinstance(model, Module) or not model.built:
        raise ValueError("save() needs a built model.")
    directory = _json.check_path(directory, "directory")
    missing = [p for p, m in model.modules().items() if m.__dict__.get("_config") is None]
    if missing:
        raise ValueError(
            f"Cannot save: constructor arguments of {missing} have no JSON form (use names such "
            "as 'relu' for activations and initializers, not functions)."
        )
    spec = model.__dict__.get("_build_spec")
    if not spec:
        raise ValueError("Cannot save: the model was not built through Module.build() with array inputs.")
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    arrays, dtypes = {}, {}
    for path, leaf in leaves:
        key = jax.tree_util.keystr(path)
        arrays[key], dtypes[key] = _storable(leaf)
    manifest = {
        "format": FORMAT,
        "config": json.loads(model._config),
        "build_inputs": json.loads(spec),
        "policy_map": policies.serialize(_policy_map(model)),
        "kernels": model.kernels(),
        "dtypes": dtypes,
    }
    calibrated = weight_calibration.calibrated_layers(model)
    if calibrated:  # GPTQ/AWQ layers whose weights came from calibration (see load)
        manifest["calibrated"] = list(calibrated)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    os.makedirs(directory, exist_ok=True)
    _atomic.write_bytes(os.path.join(directory, WEIGHTS_FILE), buffer.getvalue())
    _atomic.write_json(os.path.join(directory, MODEL_FILE), manifest)


class DamagedSaveError(ValueError):
    """A saved model whose files are damaged (truncated, garbled, or not matching each other).

    Attributes:
      directory: The saved model's directory.
      detail: What is wrong, e.g. ``"weights.npz is not a readable .npz archive (...)"``.
    """

    def __init__(self, directory: str, detail: str):
        super().__init__(
            f"The saved model in {directory!r} is damaged: {detail}. Save the model again with nn.save, or restore "
            "its files from a backup."
        )
        self.directory = directory
        self.detail = detail


class _Damaged(Exception):
    """A detail of what is wrong with a save; :func:`load` turns it into one ValueError."""


def _zeros(spec: Any) -> Any:
    if isinstance(spec, dict) and "shape" in spec:
        shape = spec["shape"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _Damaged(f"build input shape {shape!r} is not a list of sizes")
        return jnp.zeros(shape, jnp.dtype(spec["dtype"]))
    if isinstance(spec, dict) and "value" in spec:
        return spec["value"]
    if isinstance(spec, list):
        return [_zeros(s) for s in spec]
    if isinstance(spec, dict):
        return {k: _zeros(v) for k, v in spec.items()}
    raise _Damaged(f"malformed build input spec {spec!r}")


def _read(directory: str, name: str) -> bytes:
    try:
        with open(os.path.join(directory, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"No saved model at {directory!r} (nn.save writes a directory with {MODEL_FILE} and {WEIGHTS_FILE})."
            ) from None
        raise FileNotFoundError(
            f"The saved model in {directory!r} is incomplete: it has no {name}. Save the model again with "
            "nn.save (or restore the file)."
        ) from None


def _manifest(raw: bytes, directory: str) -> dict[str, Any]:
    try:
        manifest = _json.loads(raw, MODEL_FILE, "JSON")
    except ValueError as e:
        raise _Damaged(str(e)) from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        raise ValueError(f"{MODEL_FILE} in {directory!r} is not an autopolicy model (expected format "
                         f"{FORMAT!r}{' or an earlier one' if len(READABLE_FORMATS) > 1 else ''}).")
    missing = [k for k in ("config", "build_inputs", "policy_map", "dtypes") if k not in manifest]
    if missing:
        raise _Damaged(f"{MODEL_FILE} lacks {missing}")
    inputs = manifest["build_inputs"]
    if not isinstance(inputs, dict) or not isinstance(inputs.get("args"), list) or not isinstance(
            inputs.get("kwargs"), dict):
        raise _Damaged(f"{MODEL_FILE} has malformed build_inputs {str(inputs)[:80]!r}")
    if not isinstance(manifest["dtypes"], dict):
        raise _Damaged(f"{MODEL_FILE} has malformed dtypes {str(manifest['dtypes'])[:80]!r}")
    return manifest


def _class_names(config: Any) -> set[str]:
    """The module classes a config constructs (``{"class": ..., "args": ..., "kwargs": ...}``)."""
    if isinstance(config, list):
        return set().union(*(_class_names(v) for v in config))
    if not isinstance(config, dict):
        return set()
    call = {"class", "args", "kwargs"} <= set(config) and isinstance(config["class"], str)
    names = {config["class"]} if call else set()
    return names.union(*(_class_names(v) for v in config.values()))


def _rebuild(manifest: dict[str, Any], classes: dict[str, type], directory: str) -> Module:
    unknown = sorted(_class_names(manifest["config"]) - set(classes))
    if unknown:
        raise ValueError(
            f"Cannot rebuild the model saved in {directory!r}: unknown layer classes {unknown}. Register them with "
            "autopolicy.nn.register_serializable or pass custom_objects={'Name': Class} to load()."
        )
    try:
        model = _config.decode_call(manifest["config"], classes)
    except Exception as e:  # pylint: disable=broad-except
        raise _Damaged(f"its config does not rebuild a model ({type(e).__name__}: {e})") from e
    if not isinstance(model, Module):
        raise _Damaged(f"its config rebuilds a {type(model).__name__}, not a module")
    try:
        policy_map = policies.deserialize(manifest["policy_map"])
        model = model.with_dtype_policy(policy_map)
        inputs = manifest["build_inputs"]
        model = model.build(jax.random.key(0), *_zeros(inputs["args"]), **_zeros(inputs["kwargs"]))
        # Layers made while building (a LlamaAttention's output projection, a SwiGLU's down
        # projection: their sizes come from the call) did not exist for the map above.
        if any(m.dtype_policy != policy_map[p] for p, m in model.modules().items() if policy_map.matching_keys(p)):
            model = model.with_dtype_policy(policy_map)
        model = model.with_kernels(_runnable_kernels(model, dict(manifest.get("kernels") or {})))
        # Building gives GPTQ/AWQ layers their float kernels, awaiting calibration; the saved ones
        # were calibrated: give them the calibrated form, which the saved arrays then fill.
        return weight_calibration.with_calibrated_placeholders(model, manifest.get("calibrated") or ())
    except _Damaged:
        raise
    except Exception as e:  # pylint: disable=broad-except
        raise _Damaged(f"its policies or build inputs do not rebuild the model ({type(e).__name__}: {e})") from e


def _array(stored: Any, key: str) -> np.ndarray:
    try:
        return stored[key]
    except ValueError as e:
        if "allow_pickle" in str(e):  # never NumPy's advice to unpickle: nothing is unpickled here
            raise _Damaged(f"{WEIGHTS_FILE} holds a Python object array under {key!r}, not numbers") from None
        raise _Damaged(f"{WEIGHTS_FILE}: the array {key!r} is unreadable ({e})") from None
    except Exception as e:  # pylint: disable=broad-except
        raise _Damaged(f"{WEIGHTS_FILE}: the array {key!r} is unreadable ({type(e).__name__}: {e})") from None


def _migrate(key: str, arr: np.ndarray, saved_format: str) -> np.ndarray:
    """A stored array in the current format: int4 kernels (``uint8`` kernels are only int4's)
    saved by format /1 are repacked from split halves to consecutive rows."""
    if saved_format == "autopolicy.nn/1" and arr.dtype == np.uint8 and key.endswith(".kernel"):
        from autopolicy.numerics import int4  # pylint: disable=import-outside-toplevel

        # 2 * rows: with an odd K, the old padding row (0) becomes the new one, in the same place.
        return int4.repack_split_halves(arr, 2 * arr.shape[0])
    return arr


def _weights(raw: bytes, model: Module, dtypes: dict[str, Any], saved_format: str = FORMAT) -> list[jax.Array]:
    try:
        stored = np.load(io.BytesIO(raw), allow_pickle=False)
    except Exception as e:  # pylint: disable=broad-except
        raise _Damaged(f"{WEIGHTS_FILE} is not a readable .npz archive ({type(e).__name__}: {e})") from None
    if not isinstance(stored, np.lib.npyio.NpzFile):
        raise _Damaged(f"{WEIGHTS_FILE} is a single .npy array, not an .npz archive")
    with stored:
        leaves = jax.tree_util.tree_flatten_with_path(model)[0]
        keys = [jax.tree_util.keystr(p) for p, _ in leaves]
        if sorted(keys) != sorted(stored.files):
            raise _Damaged(
                f"{WEIGHTS_FILE} does not match the rebuilt model: missing {sorted(set(keys) - set(stored.files))}, "
                f"unexpected {sorted(set(stored.files) - set(keys))}"
            )
        values = []
        for key, (_, leaf) in zip(keys, leaves):
            arr = _array(stored, key)
            try:
                dtype = np.dtype(dtypes[key])
                if arr.dtype != dtype:
                    arr = arr.view(dtype)
            except Exception as e:  # pylint: disable=broad-except
                raise _Damaged(f"the dtype of {key!r} ({dtypes.get(key)!r}) does not fit its array "
                               f"({type(e).__name__}: {e})") from None
            if arr.shape != leaf.shape or dtype != leaf.dtype:
                raise _Damaged(f"{key}: saved {dtype}{arr.shape}, the model has {leaf.dtype}{leaf.shape}")
            values.append(jax.device_put(np.asarray(_migrate(key, arr, saved_format))))
    return values


def _runnable_kernels(model: Module, kernels: dict) -> dict:
    """The saved kernel choices this process can run (:func:`autopolicy.numerics.kernels.runnable`)."""
    return kernels_mod.runnable(model.layers_by_path(), kernels, "saved")


def load(directory: str | os.PathLike, custom_objects: dict[str, type] | None = None) -> Module:
    """Rebuilds a model written by :func:`save`.

    Args:
      directory: The directory :func:`save` wrote.
      custom_objects: ``{"ClassName": Class}`` for your own Module subclasses (or register them
        with :func:`register_serializable`).

    Raises:
      TypeError: if ``directory`` is not a str or os.PathLike.
      FileNotFoundError: if the directory or one of its two files is missing.
      DamagedSaveError: (a ValueError) one message naming the directory, for damaged files (a
        truncated or garbled ``weights.npz``, a malformed ``model.json``, a key repeated in it,
        weights that do not match the rebuilt architecture).
      ValueError: for a layer class that is not registered, or a ``model.json`` of another kind.

    >>> import tempfile
    >>> from autopolicy import nn
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save(nn.Dense(2).build(jax.random.key(0), jnp.ones((1, 3))), d)
    ...     with open(os.path.join(d, WEIGHTS_FILE), "r+b") as f:
    ...         _ = f.truncate(100)
    ...     load(d)
    Traceback (most recent call last):
    ...
    autopolicy.nn.serialization.DamagedSaveError: The saved model in '...' is damaged: weights.npz
    is not a readable .npz archive (...). Save the model again with nn.save, or restore its files
    from a backup.
    """
    directory = _json.check_path(directory, "directory")
    classes = {**_config.registered(), **(custom_objects or {})}
    model_raw = _read(directory, MODEL_FILE)
    try:
        manifest = _manifest(model_raw, directory)
        model = _rebuild(manifest, classes, directory)
        values = _weights(_read(directory, WEIGHTS_FILE), model, manifest["dtypes"], manifest["format"])
    except _Damaged as e:
        raise DamagedSaveError(directory, str(e)) from None
    model = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(model), values)
    if manifest.get("calibrated"):  # the placeholders' layouts know nothing of the saved g_idx
        model = weight_calibration.with_calibrated_layouts(model)
    return model
