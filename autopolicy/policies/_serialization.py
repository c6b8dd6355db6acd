"""Keras-compatible serialization of policies and maps, and policy-map files.

Deserialization only ever builds the classes of this package: it never imports a module named in
the JSON, evaluates anything or unpickles anything.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from autopolicy import _atomic, _json
from autopolicy.policies import _global, _modes, _names
from autopolicy.policies._map import DTypePolicyMap
from autopolicy.policies._policy import POLICY_CLASSES, DTypePolicy

__all__ = ["get", "serialize", "deserialize", "save_policy_map", "load_policy_map"]

_QUANTIZED_MODULE = "keras.dtype_policies"
# class_name -> (class, module Keras writes, config keys it may carry). The quantized classes and
# their keys come from the registry of quantization modes. "FloatDTypePolicy" (Keras 3.0-3.3)
# and "Policy" (tf.keras 2) are read for compatibility and never written.
_CLASSES: dict[str, tuple[type, str, tuple[str, ...]]] = {
    "DTypePolicy": (DTypePolicy, "keras", ("name",)),
    "FloatDTypePolicy": (DTypePolicy, "keras", ("name",)),
    "Policy": (DTypePolicy, "keras", ("name",)),
    **{
        form.class_name: (POLICY_CLASSES[form.class_name], _QUANTIZED_MODULE, form.config_keys)
        for mode in _modes.MODES
        for form in mode.forms
    },
    "DTypePolicyMap": (DTypePolicyMap, _QUANTIZED_MODULE, ("default_policy", "policy_map")),
}
_WRITTEN_CLASS_NAMES = tuple(k for k in _CLASSES if k not in ("FloatDTypePolicy", "Policy"))
_MODULE_PREFIXES = ("keras", "tf_keras", "tensorflow", "autopolicy")
_ENVELOPE_KEYS = ("module", "class_name", "config", "registered_name")


def _class_name(policy: DTypePolicy | DTypePolicyMap) -> str:
    if isinstance(policy, DTypePolicyMap):
        return "DTypePolicyMap"
    if isinstance(policy, DTypePolicy):
        return policy.keras_class_name
    raise ValueError(f"Cannot serialize {policy!r}: expected a DTypePolicy or DTypePolicyMap.")


def serialize(policy: DTypePolicy | DTypePolicyMap) -> dict[str, Any]:
    """Returns the JSON-able dict Keras 3 writes for ``policy`` (its exact envelope).

    >>> serialize(DTypePolicy("mixed_float16"))
    {'module': 'keras', 'class_name': 'DTypePolicy', 'config': {'name': 'mixed_float16'}, 'registered_name': None}
    """
    class_name = _class_name(policy)
    return {
        "module": _CLASSES[class_name][1],
        "class_name": class_name,
        "config": policy.get_config(),
        "registered_name": None,
    }


def deserialize(config: Any) -> DTypePolicy | DTypePolicyMap:
    """Builds a policy or map from :func:`serialize`'s output or from Keras-written JSON.

    Keras's ``"name": null`` / ``"source_name": null`` (its follow-the-global form) resolve to
    the global policy.

    Raises:
      ValueError: for anything that is not such a dict: unknown class, unknown module, a custom
        registered class, missing or unexpected config keys, or invalid values.
    """
    if not isinstance(config, dict):
        raise ValueError(f"A serialized dtype policy is a dict. Received: {config!r}")
    unexpected = sorted(set(config) - set(_ENVELOPE_KEYS))
    if unexpected:
        raise ValueError(f"Unexpected keys {unexpected} in a serialized dtype policy: {config!r}")
    class_name = config.get("class_name")
    if class_name not in _CLASSES:
        raise ValueError(
            f"Unknown dtype policy class. Expected one of {_WRITTEN_CLASS_NAMES}. "
            f"Received: class_name={class_name!r}"
        )
    module = config.get("module")
    if module is not None and not (
        isinstance(module, str) and module.split(".")[0] in _MODULE_PREFIXES
    ):
        raise ValueError(
            f"Unknown module for {class_name}: expected a Keras module. Received: module={module!r}"
        )
    if config.get("registered_name") not in (None, class_name):
        raise ValueError(
            "Custom registered dtype policies are not supported. "
            f"Received: registered_name={config.get('registered_name')!r}"
        )
    cls, _, keys = _CLASSES[class_name]
    inner = config.get("config")
    if not isinstance(inner, dict):
        raise ValueError(f"The config of a {class_name} is a dict. Received: config={inner!r}")
    unknown = sorted(set(inner) - set(keys))
    if unknown:
        raise ValueError(
            f"Unexpected config keys {unknown} for {class_name}. Expected keys: {keys}."
        )
    try:
        return cls.from_config(inner)
    except TypeError as e:
        raise ValueError(f"Invalid config for {class_name}: {e}") from None


def get(identifier: Any) -> DTypePolicy | DTypePolicyMap:
    """Converts anything that names a policy into a policy.

    Args:
      identifier: None (the global policy), a policy or map (returned as is), a name
        (``"int8_from_mixed_bfloat16"``), a serialized dict, or a NumPy/JAX dtype.

    Raises:
      ValueError: if ``identifier`` names no valid policy.

    >>> get("int8_from_mixed_bfloat16")
    <QuantizedDTypePolicy "int8_from_mixed_bfloat16">
    >>> get(np.float16)
    <DTypePolicy "float16">
    """
    if identifier is None:
        return _global.dtype_policy()
    if isinstance(identifier, (DTypePolicy, DTypePolicyMap)):
        return identifier
    if isinstance(identifier, dict):
        return deserialize(identifier)
    if isinstance(identifier, str):
        return _from_name(identifier)
    message = (
        "Cannot interpret the dtype policy identifier. Expected None, a policy, a name "
        f"({_names.VALID_FORMS}), a serialized dict or a dtype. Received: {identifier!r}"
    )
    # Only dtypes and scalar types (np.float16, jnp.bfloat16): NumPy reads much else as a dtype
    # (np.dtype([]) is 'void'), and the message would then name that instead of the value.
    if not isinstance(identifier, (np.dtype, type)):
        raise ValueError(message)
    try:
        return _from_name(_names.dtype_name(identifier))
    except (TypeError, ValueError):
        raise ValueError(message) from None


def _from_name(name: str) -> DTypePolicy:
    parts = _names.split_quantized(name)
    if parts is None:
        return DTypePolicy(name)
    spelling, source = parts
    found = _modes.find_form(spelling)
    if found is None:
        raise ValueError(
            f"Invalid quantization mode in policy name. Expected one of {_modes.SPELLINGS}. "
            f"Received: name={name!r}"
        )
    try:
        return POLICY_CLASSES[found[1].class_name](spelling, source)
    except ValueError as e:
        raise ValueError(f"{e} (in the policy name {name!r})") from None


def save_policy_map(policy_map: DTypePolicyMap, path: str | os.PathLike) -> None:
    """Writes ``policy_map`` to ``path`` as Keras-envelope JSON, atomically.

    Raises:
      TypeError: if ``policy_map`` is not a DTypePolicyMap or ``path`` not a str or os.PathLike.
    """
    if not isinstance(policy_map, DTypePolicyMap):
        raise TypeError(
            f"save_policy_map expects a DTypePolicyMap. Received: {type(policy_map).__name__}"
        )
    _atomic.write_json(_json.check_path(path), serialize(policy_map))


def load_policy_map(path: str | os.PathLike) -> DTypePolicyMap:
    """Reads a policy map written by :func:`save_policy_map` or by Keras.

    Raises:
      TypeError: if ``path`` is not a str or os.PathLike (an int is not read as a file
        descriptor).
      FileNotFoundError: if ``path`` does not exist.
      ValueError: if the file is not JSON (a key repeated within an object included: JSON
        parsers keep the last one silently) or does not hold a serialized DTypePolicyMap.
    """
    config = _json.read(path, expected="a JSON policy map")
    loaded = deserialize(config)
    if not isinstance(loaded, DTypePolicyMap):
        raise ValueError(
            f"{os.fspath(path)!r} holds a {type(loaded).__name__}, not a DTypePolicyMap."
        )
    return loaded
