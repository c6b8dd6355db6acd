"""Constructor arguments as JSON, so that a saved model can be rebuilt without pickle.

Every module records how it was constructed (its class name and arguments). Values are encoded
with tags; decoding only ever builds registered classes, policies and regularizers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from autopolicy import policies
from autopolicy.nn.regularizers import L1L2

__all__ = ["encode_call", "decode_call", "register", "register_data", "registered", "Unserializable"]

_REGISTRY: dict[str, type] = {}
_DATA: dict[str, type] = {}  # frozen dataclasses a constructor may take (LlamaConfig)


class Unserializable(ValueError):
    """A constructor argument has no JSON form (a lambda, an arbitrary object)."""


def register(cls: type) -> type:
    """Makes a Module subclass loadable by name (built-in layers are registered already)."""
    _REGISTRY[cls.__qualname__] = cls
    return cls


def register_data(cls: type) -> type:
    """Makes a dataclass of plain fields (``nn.LlamaConfig``) a constructor argument that saves
    and loads: encoded as its class name and fields, rebuilt only if registered."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_data takes a dataclass. Received: {cls!r}")
    _DATA[cls.__qualname__] = cls
    return cls


def registered() -> dict[str, type]:
    return dict(_REGISTRY)


def _encode(value: Any) -> Any:
    from autopolicy.nn._module import Module  # pylint: disable=import-outside-toplevel

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, (list, tuple)):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: _encode(v) for k, v in value.items()}}
    if isinstance(value, (policies.DTypePolicy, policies.DTypePolicyMap)):
        return {"__policy__": policies.serialize(value)}
    if isinstance(value, L1L2):
        return {"__regularizer__": {"l1": value.l1, "l2": value.l2}}
    if dataclasses.is_dataclass(value) and _DATA.get(type(value).__qualname__) is type(value):
        return {"__data__": {"class": type(value).__qualname__,
                             "fields": {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}}
    if isinstance(value, Module):
        config = value.__dict__.get("_config")
        if config is None:
            raise Unserializable(f"{value!r} could not be serialized")
        return {"__module__": json.loads(config)}
    raise Unserializable(f"{type(value).__name__} {value!r} has no JSON form")


def encode_call(cls: type, args: tuple, kwargs: dict) -> str | None:
    """The JSON of ``cls(*args, **kwargs)``, or None when an argument has no JSON form."""
    try:
        return json.dumps(
            {"class": cls.__qualname__, "args": [_encode(a) for a in args],
             "kwargs": {k: _encode(v) for k, v in kwargs.items()}},
            sort_keys=True,
        )
    except Unserializable:
        return None


def _decode(value: Any, classes: dict[str, type]) -> Any:
    if isinstance(value, list):
        return [_decode(v, classes) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise ValueError(f"Malformed model config entry: {value!r}")
    (tag, body), = value.items()
    if tag == "__tuple__":
        return tuple(_decode(v, classes) for v in body)
    if tag == "__dict__":
        return {k: _decode(v, classes) for k, v in body.items()}
    if tag == "__float__":
        return float(body)
    if tag == "__policy__":
        return policies.deserialize(body)
    if tag == "__regularizer__":
        return L1L2(**body)
    if tag == "__module__":
        return decode_call(body, classes)
    if tag == "__data__":
        cls = _DATA.get(body.get("class"))
        if cls is None:
            raise ValueError(f"Unknown data class {body.get('class')!r} in a model config (registered: {sorted(_DATA)})")
        return cls(**{k: _decode(v, classes) for k, v in body.get("fields", {}).items()})
    raise ValueError(f"Unknown tag {tag!r} in a model config")


def decode_call(config: dict[str, Any], classes: dict[str, type]) -> Any:
    """Constructs the module that :func:`encode_call` described."""
    name = config.get("class")
    cls = classes.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"Unknown layer class {name!r}: register it with autopolicy.nn.register_serializable "
            "or pass custom_objects={'Name': Class} to load()."
        )
    args = [_decode(a, classes) for a in config.get("args", [])]
    kwargs = {k: _decode(v, classes) for k, v in config.get("kwargs", {}).items()}
    return cls(*args, **kwargs)
