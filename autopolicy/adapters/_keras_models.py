"""Whole Keras 3 models: a faithful copy (the same layer paths, its own variables), a policy map
applied to it in place, the sublayer policies of composite layers kept where Keras saves them,
and each leaf layer's first call recorded on sample inputs.

Shared by the Keras adapter and :mod:`autopolicy.keras`.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Iterable

import jax
import jax.numpy as jnp

from autopolicy import policies
from autopolicy.adapters._keras_layers import (
    calibrate_float8,
    canonical_name,
    keras,
    own_policy,
    require_jax_backend,
    set_layer_policy,
    source_policy,
    supported_modes,
    to_keras,
    values,
)

__all__ = [
    "LayerCall",
    "all_layers",
    "layer_index",
    "check_model",
    "copy_model",
    "align",
    "apply_policies",
    "to_policy_map",
    "record_calls",
    "calibrate",
    "mismatches",
    "remember",
    "map_of",
]


class LayerCall:
    """What one leaf layer received and returned on the sample input (its first call only)."""

    __slots__ = ("path", "layer", "args", "kwargs", "output", "producer")

    def __init__(self, path, layer, args, kwargs, output, producer):
        self.path, self.layer, self.args, self.kwargs = path, layer, args, kwargs
        self.output, self.producer = output, producer


def all_layers(model: Any) -> list:
    """Every layer under ``model`` (not itself), each once, in Keras's traversal order."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def layer_index(model: Any) -> list[list]:
    """``[path, class name, name]`` of every layer: what :func:`align` restores on a copy."""
    return [[layer.path, type(layer).__name__, layer.name] for layer in all_layers(model)]


def check_model(model: Any) -> None:
    """Raises unless ``model`` is a built ``keras.Model`` on the JAX backend."""
    require_jax_backend()
    if not isinstance(model, keras.Model):
        raise TypeError(f"Expected a keras.Model. Received: {type(model).__module__}.{type(model).__qualname__}")
    if not model.built:
        raise ValueError(f"The Keras model {model.name!r} is not built: call it on a batch (or build it) first.")


def _is_graph_model(model: Any) -> bool:
    from keras.src.models.functional import Functional  # noqa: PLC0415  (no public name)

    return isinstance(model, (keras.Sequential, Functional))


def align(copy: Any, index: list[list], name: str) -> None:
    """Gives the layers of ``copy`` the names and paths in ``index`` (a subclassed model made
    again from its config draws new automatic names: ``dense_3`` for ``dense``).

    Raises:
      ValueError: if the layers differ in number or kind (the copy is not the same model).
    """
    layers = all_layers(copy)
    kinds = [type(layer).__name__ for layer in layers]
    if kinds != [entry[1] for entry in index]:
        raise ValueError(
            f"The model rebuilt from its config has other layers than the original: {kinds} instead of "
            f"{[entry[1] for entry in index]}. Its get_config()/from_config() must rebuild the same layers."
        )
    for layer, (path, _, layer_name) in zip(layers, index):
        if layer.name != layer_name:
            layer.name = layer_name
        layer._path = path
    if copy.name != name:
        copy.name = name


def _build(copy: Any, model: Any, sample_args: tuple | None) -> None:
    if copy.built and all(layer.built for layer in all_layers(copy)):
        return
    if sample_args is not None:
        with jax.numpy_dtype_promotion("standard"):
            copy(*sample_args)
        return
    build_config = model.get_build_config()
    if build_config is None:
        raise ValueError(f"Cannot rebuild a copy of {model.name!r} without a sample input; call it on a batch first.")
    copy.build_from_config(build_config)


def built_for(model: Any) -> str | None:
    """What ``model`` takes, for an error message: ``"which was built for inputs (None, 12) float32"`` from a
    Functional or Sequential model's inputs, a subclassed model's build input shape, or None."""
    inputs = getattr(model, "_inputs_struct", None) if _is_graph_model(model) else None
    if inputs is not None:
        described = jax.tree_util.tree_map(lambda t: f"{tuple(t.shape)} {t.dtype}", inputs)
        return f"which was built for inputs {described}".replace("'", "")
    config = model.get_build_config() or {}
    shape = config.get("input_shape")
    return None if shape is None else f"which was built for input shape {tuple(shape) if isinstance(shape, list) else shape}"


def copy_model(model: Any, sample_args: tuple | None = None) -> Any:
    """A copy of a built model with the same layers, names, paths, policies and weights, and
    variables of its own (the original is never touched).

    Functional and Sequential models are cloned with ``keras.models.clone_model``; a subclassed
    model is made again with ``type(model).from_config(model.get_config())`` and built on
    ``sample_args`` (else its build config).

    Raises:
      ValueError: if the model cannot be rebuilt from its config.
    """
    check_model(model)
    try:
        if _is_graph_model(model):
            copy = keras.models.clone_model(model)
        else:
            copy = type(model).from_config(model.get_config())
        _build(copy, model, sample_args)
    except (TypeError, ValueError, NotImplementedError) as e:
        raise ValueError(
            f"autopolicy works on a copy of the Keras model and could not make one of {model.name!r} "
            f"({type(e).__name__}: {e}). A subclassed model needs get_config() and from_config() that "
            "rebuild it."
        ) from e
    align(copy, layer_index(model), model.name)
    copy.set_weights(values(model))
    if getattr(model, "compiled", False) and model.get_compile_config():
        try:
            copy.compile_from_config(model.get_compile_config())
        except Exception as e:  # pylint: disable=broad-except  # a custom loss Keras cannot rebuild
            warnings.warn(f"The copy of {model.name!r} is not compiled: {type(e).__name__}: {e}", stacklevel=2)
    return copy


def to_policy_map(policy_map: Any) -> policies.DTypePolicyMap:
    """An autopolicy ``DTypePolicyMap`` from one, a Keras ``DTypePolicyMap`` or a ``{path: policy}`` dict."""
    if isinstance(policy_map, policies.DTypePolicyMap):
        return policy_map
    if isinstance(policy_map, keras.dtype_policies.DTypePolicyMap):
        return policies.deserialize(keras.dtype_policies.serialize(policy_map))
    if isinstance(policy_map, dict):
        return policies.DTypePolicyMap("float32", policy_map)
    raise TypeError(
        "policy_map must be an autopolicy or Keras DTypePolicyMap, or a {path: policy} dict. "
        f"Received: {type(policy_map).__name__}"
    )


def _float_compute(layer: Any) -> bool:
    return not isinstance(layer, keras.layers.InputLayer) and jnp.issubdtype(jnp.dtype(layer.compute_dtype), jnp.floating)


def _targets(model: Any, policy_map: policies.DTypePolicyMap) -> list[tuple[Any, Any]]:
    """Each float layer with the policy it runs: ``map[path]``; a layer Keras gives no path
    (Dropout, Softmax, pooling) runs its nearest ancestor's policy, as Keras gives it on reload."""
    out, seen = [], set()

    def walk(parent: Any, inherited: Any) -> None:
        for layer in parent._layers:
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            target = policy_map[layer.path] if layer.path else inherited
            if _float_compute(layer):
                out.append((layer, target))
            walk(layer, target)

    walk(model, policy_map.default_policy)
    return out


def _keep_sublayer_policies(model: Any) -> None:
    """A composite layer (MultiHeadAttention) makes its sublayers again on reload with its own
    policy, losing theirs: give it a Keras ``DTypePolicyMap`` holding theirs by path, which
    its config saves and which its sublayers read by path when Keras rebuilds them."""
    kdp = keras.dtype_policies
    for layer in all_layers(model):
        if not layer._layers or isinstance(layer, keras.Model) or layer.path is None:
            continue
        own = layer._dtype_policy
        if isinstance(own, kdp.DTypePolicyMap):
            own = own[layer.path]
        entries = {sub.path: sub._dtype_policy for sub in layer._flatten_layers(include_self=False) if sub.path}
        entries = {p: (v[p] if isinstance(v, kdp.DTypePolicyMap) else v) for p, v in entries.items()}
        if all(canonical_name(v) == canonical_name(own) for v in entries.values()):
            continue
        entries[layer.path] = own
        layer._dtype_policy = kdp.DTypePolicyMap(own, entries)


def apply_policies(model: Any, policy_map: policies.DTypePolicyMap) -> dict[str, str]:
    """Makes every float layer of ``model`` run its policy under ``policy_map``, in place.

    Returns:
      ``{path: policy name}`` of the layers with a path.
    """
    converted: dict[str, Any] = {}
    chosen = {}
    for layer, target in _targets(model, policy_map):
        kpolicy = converted.setdefault(target.name, to_keras(target))
        name = set_layer_policy(layer, kpolicy)
        if layer.path:
            chosen[layer.path] = name
    _keep_sublayer_policies(model)
    return chosen


def record_calls(model: Any, batches: Iterable[tuple]) -> tuple["OrderedDict[str, LayerCall]", dict[str, float]]:
    """Runs ``model`` on each batch and records every leaf layer's first call, in execution
    order, with the absolute maximum of its first floating input over all batches.

    The layers' ``call`` is wrapped for the run only; pass a copy, never the user's model.
    """
    leaves = [layer for layer in all_layers(model) if not layer._layers and layer.path]
    calls: OrderedDict[str, LayerCall] = OrderedDict()
    amax: dict[str, float] = {}
    producers: dict[int, str] = {}

    def wrap(layer: Any, original: Any):
        @functools.wraps(original)
        def call(*args, **kwargs):
            out = original(*args, **kwargs)
            leaves_in = jax.tree_util.tree_leaves((args, kwargs))
            floats = [x for x in leaves_in if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
            if floats:
                amax[layer.path] = max(amax.get(layer.path, 0.0), float(jnp.max(jnp.abs(floats[0]))))
            if layer.path not in calls:
                producer = producers.get(id(leaves_in[0])) if leaves_in else None
                calls[layer.path] = LayerCall(layer.path, layer, args, kwargs, out, producer)
                for leaf in jax.tree_util.tree_leaves(out):
                    producers[id(leaf)] = layer.path
            return out

        return call

    saved = []
    try:
        for layer in leaves:
            saved.append((layer, layer.__dict__.get("call")))
            layer.__dict__["call"] = wrap(layer, layer.call)
        with jax.numpy_dtype_promotion("standard"):
            for batch in batches:
                model(*batch)
    finally:
        for layer, previous in saved:
            if previous is None:
                del layer.__dict__["call"]
            else:
                layer.__dict__["call"] = previous
    return calls, amax


def calibrate(model: Any, amax: dict[str, float]) -> None:
    """Sets the scales of the float8 layers of ``model`` from recorded input maxima."""
    for layer in all_layers(model):
        if layer.path in amax and getattr(layer, "quantization_mode", None) == "float8" and not layer._layers:
            calibrate_float8(layer, amax[layer.path])


def mismatches(model: Any, policy_map: policies.DTypePolicyMap) -> list[tuple[str, str, str]]:
    """``(layer, policy it runs, policy the map gives it)`` for every layer not running its map
    policy (a quantized policy without a kernel reads as its source)."""
    out = []
    for layer, target in _targets(model, policy_map):
        expected = to_keras(target)
        if expected.quantization_mode and expected.quantization_mode not in supported_modes(layer):
            expected = source_policy(expected)
        runs = own_policy(layer)
        if canonical_name(runs) != canonical_name(expected):
            out.append((layer.path or layer.name, runs.name, expected.name))
    return out


_MAPS: "weakref.WeakKeyDictionary[Any, policies.DTypePolicyMap]" = weakref.WeakKeyDictionary()


def remember(model: Any, policy_map: policies.DTypePolicyMap) -> None:
    """Records the map a model was made to run (what ``autopolicy.keras.save`` stores)."""
    _MAPS[model] = policy_map


def map_of(model: Any) -> policies.DTypePolicyMap | None:
    """The map recorded for ``model`` by :func:`remember`, or None."""
    return _MAPS.get(model)
