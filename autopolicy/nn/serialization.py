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
from autopolicy.nn import _config
from autopolicy.nn._module import Module

__all__ = ["save", "load", "register_serializable"]

FORMAT = "autopolicy.nn/1"
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
    as a Keras ``DTypePolicyMap``, array dtypes) and ``weights.npz``; each written atomically.

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
        "dtypes": dtypes,
    }
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    os.makedirs(directory, exist_ok=True)
    _atomic.write_bytes(os.path.join(directory, WEIGHTS_FILE), buffer.getvalue())
    _atomic.write_json(os.path.join(directory, MODEL_FILE), manifest)


def _zeros(spec: Any) -> Any:
    if isinstance(spec, dict) and "shape" in spec:
        return jnp.zeros(spec["shape"], jnp.dtype(spec["dtype"]))
    if isinstance(spec, dict) and "value" in spec:
        return spec["value"]
    if isinstance(spec, list):
        return [_zeros(s) for s in spec]
    if isinstance(spec, dict):
        return {k: _zeros(v) for k, v in spec.items()}
    raise ValueError(f"Malformed build input spec: {spec!r}")


def load(directory: str | os.PathLike, custom_objects: dict[str, type] | None = None) -> Module:
    """Rebuilds a model written by :func:`save`.

    Args:
      directory: The directory :func:`save` wrote.
      custom_objects: ``{"ClassName": Class}`` for your own Module subclasses (or register them
        with :func:`register_serializable`).

    Raises:
      TypeError: if ``directory`` is not a str or os.PathLike.
      FileNotFoundError: if a file is missing.
      ValueError: if the files are malformed (a key repeated in ``model.json`` included) or do
        not match the rebuilt architecture.
    """
    directory = _json.check_path(directory, "directory")
    with open(os.path.join(directory, MODEL_FILE), "rb") as f:
        manifest = _json.loads(f.read(), f"{MODEL_FILE} in {directory!r}", "JSON")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{MODEL_FILE} is not an autopolicy model (expected format {FORMAT!r}).")
    classes = {**_config.registered(), **(custom_objects or {})}
    model = _config.decode_call(manifest["config"], classes)
    model = model.with_dtype_policy(policies.deserialize(manifest["policy_map"]))
    inputs = manifest["build_inputs"]
    model = model.build(jax.random.key(0), *_zeros(inputs["args"]), **_zeros(inputs["kwargs"]))
    with np.load(os.path.join(directory, WEIGHTS_FILE), allow_pickle=False) as stored:
        leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
        keys = [jax.tree_util.keystr(p) for p, _ in leaves]
        if sorted(keys) != sorted(stored.files):
            raise ValueError(
                f"The saved weights do not match the rebuilt model: missing {sorted(set(keys) - set(stored.files))}, "
                f"unexpected {sorted(set(stored.files) - set(keys))}."
            )
        values = []
        for key, (_, leaf) in zip(keys, leaves):
            arr = stored[key]
            dtype = np.dtype(manifest["dtypes"][key])
            if arr.dtype != dtype:
                arr = arr.view(dtype)
            if arr.shape != leaf.shape or dtype != leaf.dtype:
                raise ValueError(f"{key}: saved {dtype}{arr.shape}, model has {leaf.dtype}{leaf.shape}")
            values.append(jnp.asarray(arr))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(model), values)
