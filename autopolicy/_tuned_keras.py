""":func:`autopolicy.load_tuned` for Keras models (``tuned/model.keras``)."""

from __future__ import annotations

import logging
import os
from typing import Any

import autopolicy.keras as apk
from autopolicy import policies
from autopolicy._tuned import _KERAS_FILE, TunedModelError, _warn_if_other_weights, check_same
from autopolicy.adapters import _keras_kernels, _keras_models
from autopolicy.numerics import kernels as kernel_specs

__all__ = ["load"]

_log = logging.getLogger("autopolicy")


def _from_calibration(layer: Any) -> bool:
    mode = getattr(layer, "quantization_mode", None)
    return mode is not None and (mode == "float8" or (mode in policies.QUANTIZATION_MODES
                                                      and policies.get_quantization_mode(mode).calibrated))


def _layout(model: Any) -> dict[str, str]:
    return {layer.path: type(layer).__name__ for layer in _keras_models.all_layers(model) if layer.path}


def _with_kernels(model: Any, kernels: dict[str, str]) -> Any:
    """Each int8 layer runs the kernel the tune chose, where this process can run it."""
    dropped = {}
    for layer in _keras_models.all_layers(model):
        kernel = kernels.get(layer.path)
        if kernel is None or getattr(layer, "quantization_mode", None) != "int8":
            continue
        if kernel_specs.kernel_spec("int8", kernel).runnable:
            _keras_kernels.with_kernel(layer, kernel)
        else:
            dropped[layer.path] = kernel
    if dropped:
        _log.warning("autopolicy: %d layer(s) were chosen with kernels this process cannot run (%s, e.g. %r); they "
                     "run their mode's default kernel here.", len(dropped), ", ".join(sorted(set(dropped.values()))),
                     next(iter(dropped)))
    return model


def load(directory: str, manifest: dict[str, Any], model: Any) -> Any:
    stored = apk.load(os.path.join(directory, _KERAS_FILE))
    kernels = manifest.get("kernels") or {}
    if model is None:
        return _with_kernels(stored, kernels)
    check_same(_layout(stored), _layout(model), "layer")
    policy_map = apk.policy_map_of(stored)
    if policy_map is None:  # pragma: no cover  (apk.load remembers the archive's map)
        raise TunedModelError(f"{directory!r}'s Keras archive holds no policy map.")
    tuned = apk.apply_policy_map(model, policy_map)
    stored_layers = {layer.path: layer for layer in _keras_models.all_layers(stored)}
    calibrated = sorted(path for path, layer in stored_layers.items() if _from_calibration(layer))
    for layer in _keras_models.all_layers(tuned):
        if layer.path not in calibrated:
            continue
        source = stored_layers[layer.path]
        for mine, theirs in zip(layer.weights, source.weights):
            if tuple(mine.shape) != tuple(theirs.shape):
                raise TunedModelError(f"model does not match the run's architecture: weight {mine.path!r} is "
                                      f"{tuple(mine.shape)} in model, {tuple(theirs.shape)} in the run.")
            mine.assign(theirs.value)
    _warn_if_other_weights(model, "keras", manifest, calibrated)
    return _with_kernels(tuned, kernels)
