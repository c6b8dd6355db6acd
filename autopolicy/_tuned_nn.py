""":func:`autopolicy.load_tuned` for ``autopolicy.nn`` models (``tuned/`` written by ``nn.save``)."""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

from autopolicy import policies
from autopolicy._tuned import TunedModelError, _warn_if_other_weights, check_same
from autopolicy.nn import _base, serialization
from autopolicy.nn._module import Module
from autopolicy.numerics import kernels as kernel_specs

__all__ = ["load"]


def _from_calibration(layer: Module) -> bool:
    mode = layer.quantization_mode
    return mode is not None and (mode == "float8" or policies.get_quantization_mode(mode).calibrated)


def _layout(model: Module) -> dict[str, str]:
    """``{path: class and constructor arguments}`` of every module (name and policy left out; a
    container by its class alone: its children are compared one by one)."""
    out = {}
    for path, module in model.modules().items():
        if module.children():
            out[path] = type(module).__name__
            continue
        config = json.loads(module.__dict__.get("_config") or "{}")
        for kwarg in ("name", "dtype"):
            config.get("kwargs", {}).pop(kwarg, None)
        arguments = [json.dumps(a) for a in config.get("args", [])] + [
            f"{k}={json.dumps(v, sort_keys=True)}" for k, v in sorted(config.get("kwargs", {}).items())]
        out[path] = f"{type(module).__name__}({', '.join(arguments)})"
    return out


def _shapes(layer: Module) -> tuple:
    return tuple(tuple(np.shape(x)) for x in jax.tree_util.tree_leaves(layer))


def load(directory: str, manifest: dict[str, Any], model: Module | None) -> Module:
    stored = serialization.load(directory)  # the saved kernels, those this CPU cannot run left out
    if model is None:
        return stored
    if not model.built:
        raise TunedModelError("model must be built, as the float model the run tuned was.")
    check_same(_layout(stored), _layout(model), "layer")
    policy_map = serialization._policy_map(stored)  # pylint: disable=protected-access
    stored_layers = stored.layers_by_path()
    calibrated = {path for path, layer in stored_layers.items() if _from_calibration(layer)}
    tuned = model.with_dtype_policy(policy_map)
    tuned_layers = tuned.layers_by_path()
    for path, layer in stored_layers.items():
        if path not in calibrated and _shapes(layer) != _shapes(tuned_layers[path]):
            raise TunedModelError(f"model does not match the run's architecture: the weights of layer {path!r} are "
                                  f"shaped {_shapes(tuned_layers[path])} under {layer.dtype_policy.name!r} in model, "
                                  f"{_shapes(layer)} in the run.")
    _warn_if_other_weights(model, "autopolicy.nn", manifest, sorted(calibrated))
    if calibrated:
        tuned = _base.map_modules(tuned, lambda m: stored_layers[m.path] if m.path in calibrated else None)
    chosen = kernel_specs.runnable(tuned.layers_by_path(), manifest.get("kernels") or {}, "chosen")
    return tuned.with_kernels(chosen) if chosen else tuned
