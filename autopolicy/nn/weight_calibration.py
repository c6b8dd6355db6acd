"""Calibration of GPTQ and AWQ weights: layer by layer, in execution order, on real inputs."""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp

from autopolicy.nn import _base, _context
from autopolicy.nn._module import Module
from autopolicy.numerics import awq, gptq, modes, weight_only

__all__ = ["calibrate_weights", "uncalibrated_layers"]


class _Captured(Exception):
    """Ends a forward pass once the wanted layer's inputs are recorded."""


def uncalibrated_layers(model: Module) -> tuple[str, ...]:
    """Paths of the layers whose GPTQ or AWQ weights await calibration (in path order)."""
    out = []
    for path, layer in model.layers_by_path().items():
        mode = layer.__dict__.get("_weights_mode")
        if mode is None:
            continue
        entry = modes.numerics_of(mode)
        if entry.is_calibrated is not None and not entry.is_calibrated(
                {name: getattr(layer, name) for name in entry.state}):
            out.append(path)
    return tuple(out)


def _as_args(batch: Any) -> tuple:
    return batch if isinstance(batch, tuple) else (batch,)


def _capture(model: Module, paths: tuple[str, ...], batches: list, stop: bool) -> dict[str, list[jax.Array]]:
    """The first positional input of every call of the layers at ``paths`` over ``batches``, as
    ``(rows, K)`` float32; uncalibrated layers run their float kernels. ``stop``: end each pass
    once a call of the (single) layer has been recorded."""
    seen: dict[str, list[jax.Array]] = {p: [] for p in paths}
    order: list[str] = []

    def hook(layer: Any, args: tuple, kwargs: dict) -> None:
        del kwargs
        if layer.path in seen:
            seen[layer.path].append(layer.matmul_rows(jnp.asarray(args[0], jnp.float32)))
            if layer.path not in order:
                order.append(layer.path)
            if stop:
                raise _Captured

    with _context.calibrating(), _context.call_hook(hook):
        for batch in batches:
            try:
                model(*_as_args(batch))
            except _Captured:
                pass
    seen["__order__"] = order  # type: ignore[assignment]
    return seen


def _calibrated_layer(layer: Module, inputs: list[jax.Array], options: dict) -> tuple[Module, dict]:
    """A copy of ``layer`` holding its calibrated weights, and a note of what was chosen."""
    policy = layer.dtype_policy
    mode, bits, group_size = policy.quantization_mode, policy.weight_bits, policy.group_size
    kernel = layer.matmul_kernel(jnp.asarray(layer.kernel, jnp.float32))  # (K, N)
    note: dict[str, Any] = {"mode": mode, "rows": int(sum(x.shape[0] for x in inputs))}
    if mode == "gptq":
        hessian, count = None, 0
        for x in inputs:
            hessian, count = gptq.hessian_update(hessian, count, x)
        q, scale, zero, g_idx = gptq.gptq_quantize(kernel, hessian, bits, group_size, damping=options["damping"],
                                                   act_order=options["act_order"])
        arrays = weight_only.store(q, scale, zero, g_idx, bits, layer.variable_dtype)
    else:
        x = jnp.concatenate(inputs)
        q, scale, zero, g_idx, s, alpha = awq.awq_quantize(kernel, x, bits, group_size, n_grid=options["n_grid"])
        arrays = weight_only.store(q, scale, zero, g_idx, bits, layer.variable_dtype)
        arrays["awq_scales"] = s.astype(layer.variable_dtype)
        note["alpha"] = alpha
    new = layer._copy(mutable=True)
    for key, value in arrays.items():
        object.__setattr__(new, key, value)
    new._nontrainable = tuple(sorted(set(new._nontrainable) | set(arrays)))
    # Decided here, where g_idx is a concrete array: the XLA path then needs no gather.
    new._calibrated_layout = weight_only.calibrated_layout(layer._weights_layout, g_idx)
    new._freeze()
    return new, note


def _replace(model: Module, path: str, new: Module) -> Module:
    return _base.map_modules(model, lambda m: new if m.path == path else None)


def calibrate_weights(
    model: Module,
    batches: Iterable[Any],
    *,
    sequential: bool = True,
    damping: float = gptq.DEFAULT_DAMPING,
    act_order: bool = False,
    n_grid: int = awq.DEFAULT_GRID,
    report: dict | None = None,
) -> Module:
    """Sets the weights of every GPTQ and AWQ layer of ``model`` from its real inputs.

    Layers run in execution order; each is calibrated on the inputs it receives when ``model``
    runs on ``batches`` with the layers before it already quantized (``sequential=True``, as
    GPTQ does), so each layer also corrects for the error of those before it. GPTQ: the inputs'
    Hessian ``2 X^T X / M``, damped, and column-by-column quantization with error feedback
    (:mod:`autopolicy.numerics.gptq`). AWQ: per-input-channel scales ``mean|x|^alpha``, ``alpha``
    searched on a grid for the least output error (:mod:`autopolicy.numerics.awq`). Other layers
    are left as they are. Give layers their policies first (``model.quantize("gptq/4/128")``,
    ``with_dtype_policy``); until calibrated, running such a layer raises.

    Args:
      model: A built model with ``gptq/...`` or ``awq/...`` policies on some Dense or EinsumDense
        layers (an EinsumDense kernel is calibrated and stored as the ``(K, N)`` matrix of its
        product).
      batches: Inputs to call the model on (arrays, or tuples of positional arguments); a few
        hundred to a few thousand rows per layer.
      sequential: Calibrate each layer on the outputs of the already-quantized layers before it
        (True), or every layer on the float model's inputs (False).
      damping: GPTQ's damping, a fraction of the mean of the Hessian's diagonal (Keras: 0.01).
      act_order: GPTQ quantizes columns in order of decreasing Hessian diagonal (Keras's default:
        off).
      n_grid: AWQ's grid: ``alpha`` in ``linspace(0, 1, n_grid + 1)``.
      report: If a dict, filled with ``{path: {"mode", "rows", ("alpha")}}``.

    Returns:
      The calibrated model (``model`` itself when it has no such layer).

    Raises:
      ValueError: for no batches, or a layer that the batches never reach.

    >>> import jax, jax.numpy as jnp
    >>> import autopolicy.nn as nn
    >>> x = jax.random.normal(jax.random.key(0), (64, 32))
    >>> model = nn.Sequential([nn.Dense(16, activation="relu"), nn.Dense(8)]).build(jax.random.key(1), x)
    >>> quantized = calibrate_weights(model.quantize("gptq/4/16"), [x])
    >>> quantized(x).shape, quantized.layers_by_path()["sequential/dense"].kernel.dtype
    ((64, 8), dtype('uint8'))
    """
    batches = list(batches)
    if not batches:
        raise ValueError("calibrate_weights() needs at least one batch.")
    for name, value in (("damping", damping),):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{name} must be a number in [0, 1]. Received: {name}={value!r}")
    options = {"damping": float(damping), "act_order": bool(act_order), "n_grid": n_grid}
    targets = uncalibrated_layers(model)
    if not targets:
        return model
    first = _capture(model, targets, batches[:1], stop=False)
    order = list(first["__order__"])
    missing = [p for p in targets if p not in order]
    if missing:
        raise ValueError(f"calibrate_weights: the batches never reach the layers {missing}; they cannot be "
                         "calibrated.")
    float_inputs = _capture(model, targets, batches, stop=False) if not sequential else None
    notes = {}
    for path in order:
        if sequential:
            inputs = _capture(model, (path,), batches, stop=True)[path]
        else:
            inputs = float_inputs[path]
        layer = model.layers_by_path()[path]
        new, notes[path] = _calibrated_layer(layer, inputs, options)
        model = _replace(model, path, new)
    if report is not None:
        report.update(notes)
    return model


def calibrated_layers(model: Module) -> tuple[str, ...]:
    """Paths of the layers that hold calibrated GPTQ or AWQ weights."""
    out = []
    for path, layer in model.layers_by_path().items():
        mode = layer.__dict__.get("_weights_mode")
        entry = modes.numerics_of(mode) if mode is not None else None
        if entry is not None and entry.is_calibrated is not None and entry.is_calibrated(
                {name: getattr(layer, name) for name in entry.state}):
            out.append(path)
    return tuple(out)


def with_calibrated_layouts(model: Module) -> Module:
    """``model`` with the kernels' layout of each calibrated GPTQ/AWQ layer read from its concrete
    ``g_idx`` (:func:`autopolicy.numerics.weight_only.calibrated_layout`): what loading restores
    once the saved arrays have filled the placeholders, for saves from before the layout too."""
    for path in calibrated_layers(model):
        layer = model.layers_by_path()[path]
        layout = weight_only.calibrated_layout(layer._weights_layout, layer.g_idx)
        if layout != layer.__dict__.get("_calibrated_layout"):
            model = _replace(model, path, layer._copy(_calibrated_layout=layout))
    return model


def with_calibrated_placeholders(model: Module, paths: Iterable[str]) -> Module:
    """``model`` with the layers at ``paths`` in their calibrated form, filled with placeholders
    (zeros) of the right shapes and dtypes: what loading a saved calibrated model fills in."""
    layers = model.layers_by_path()
    for path in paths:
        if path not in layers:
            raise ValueError(f"No layer {path!r} to hold calibrated weights; the model has {sorted(layers)}.")
        layer = layers[path]
        policy = layer.dtype_policy
        if policy.quantization_mode not in ("gptq", "awq") or layer.kernel is None or layer.kernel.ndim < 2:
            raise ValueError(f"{path!r} ({policy.name!r}) has no calibrated GPTQ/AWQ form.")
        shape = layer.matmul_kernel(layer.kernel).shape
        arrays = weight_only.placeholders(shape, weight_only.layout_of(policy), layer.variable_dtype,
                                          awq=policy.quantization_mode == "awq")
        new = layer._copy(mutable=True)
        for key, value in arrays.items():
            object.__setattr__(new, key, value)
        new._nontrainable = tuple(sorted(set(new._nontrainable) | set(arrays)))
        new._freeze()
        model = _replace(model, path, new)
    return model
