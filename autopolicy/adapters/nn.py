"""The model adapter for ``autopolicy.nn`` models (built, float, immutable pytrees).

Layers are recorded through the module call hook on the sample input; a layer or the model under
a policy is a new module (``with_dtype_policy``), which is itself the jit state of its program.

GPTQ and AWQ candidates (weight-only, calibrated): each layer is calibrated alone, once per
policy, on the inputs it receives when the float model runs on the calibration batches
(``calibrate_weights(..., sequential=False)``'s rule), and every model the search builds, the
chosen one included, uses those weights: what is timed and scored is what ships.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from typing import Any

import jax
import numpy as np

from autopolicy import policies
from autopolicy.nn import _base, _context
from autopolicy.nn._module import Module, lower_call
from autopolicy.nn._parts import PartOutputs
from autopolicy.nn.calibration import calibrate
from autopolicy.nn.weight_calibration import calibrate_weights, with_calibrated_placeholders
from autopolicy.numerics import kernels
from autopolicy.search import _checks
from autopolicy.adapters import _nn_first_order
from autopolicy.search.adapter import (OutputGradients, Program, TunableLayer, cast_floating, digest_arrays,
                                       register_adapter, shapes_and_dtypes)

__all__ = ["NNAdapter", "LayerCall", "record_calls"]

FLOAT32 = policies.DEFAULT_POLICY_NAME


class LayerCall:
    """What one layer received and returned on the sample input (its first call only)."""

    __slots__ = ("path", "layer", "args", "kwargs", "output", "producer")

    def __init__(self, path, layer, args, kwargs, output, producer):
        self.path, self.layer, self.args, self.kwargs = path, layer, args, kwargs
        self.output, self.producer = output, producer


def record_calls(model: Module, *args: Any, **kwargs: Any) -> "OrderedDict[str, LayerCall]":
    """Runs ``model`` once and records every leaf layer's first call, in execution order."""
    leaves = {id(m): p for p, m in model.layers_by_path().items()}
    calls: OrderedDict[str, LayerCall] = OrderedDict()
    outputs: dict[int, str] = {}

    def hook(layer, call_args, call_kwargs):
        path = leaves.get(id(layer))
        if path is None or path in calls:
            return None
        first = next(iter(jax.tree_util.tree_leaves((call_args, call_kwargs))), None)
        producer = outputs.get(id(first)) if first is not None else None

        def record(out):
            calls[path] = LayerCall(path, layer, call_args, call_kwargs, out, producer)
            for leaf in jax.tree_util.tree_leaves(out):
                outputs[id(leaf)] = path

        return record

    with _context.call_hook(hook):
        model(*args, **kwargs)
    return calls


def built_for(model: Module) -> str | None:
    """The inputs ``model`` was built on, any batch size: ``"which was built for inputs (N, 12)
    float32"`` (None when it does not record them)."""
    spec = model.__dict__.get("_build_spec")
    if not spec:
        return None

    def one(x: Any) -> Any:
        if isinstance(x, dict) and "shape" in x:
            dims = ["N", *map(str, x["shape"][1:])] if x["shape"] else []
            return f"({', '.join(dims)}{',' if len(dims) == 1 else ''}) {x['dtype']}"
        if isinstance(x, dict) and "value" in x:
            return repr(x["value"])
        if isinstance(x, list):
            return "[" + ", ".join(one(v) for v in x) + "]"
        if isinstance(x, dict):
            return "{" + ", ".join(f"{k!r}: {one(v)}" for k, v in x.items()) + "}"
        return repr(x)

    decoded = json.loads(spec)
    parts = [one(a) for a in decoded.get("args", [])] + [f"{k}={one(v)}" for k, v in decoded.get("kwargs", {}).items()]
    return ("which was built for inputs " + ", ".join(parts)) if parts else None


def _config_without_name(layer: Module) -> Any:
    """The layer's configuration without its name and policy: equal layers of different blocks
    (``block_0/query``, ``block_1/query``) share one signature, so they are timed once."""
    text = layer.__dict__.get("_config")
    if not text:
        return type(layer).__name__
    config = json.loads(text)
    for kwarg in ("name", "dtype"):
        config.get("kwargs", {}).pop(kwarg, None)
    return config


def _weights_calibrated(policy: policies.DTypePolicy) -> bool:
    """Whether the policy's weights need a calibration pass of their own (GPTQ, AWQ)."""
    mode = policy.quantization_mode
    return mode is not None and policies.get_quantization_mode(mode).calibrated


def _call_layer(layer: Module, args: tuple, kwargs: dict) -> Any:
    return layer(*args, **kwargs)


def _call_model(model: Module, *args: Any) -> Any:
    return model(*args)


class NNAdapter:
    """:class:`~autopolicy.search.adapter.ModelAdapter` for a built float ``autopolicy.nn`` model.

    Raises:
      TypeError: if ``model`` is not an ``autopolicy.nn`` module.
      ValueError: if it is not built, or is already quantized.
    """

    def __init__(self, model: Module, sample_args: tuple, calibration: list):
        if not isinstance(model, Module):
            raise TypeError(f"Expected an autopolicy.nn Module. Received: {type(model).__name__}")
        if not model.built:
            raise ValueError("The model must be built: model = model.build(jax.random.key(0), sample_input)")
        quantized = [p for p, m in model.layers_by_path().items() if m.quantization_mode is not None]
        if quantized:
            raise ValueError(f"Tune the float model, not a quantized one: {quantized} are already quantized.")
        self.model = model.with_dtype_policy(FLOAT32)
        self.calibration = list(calibration)
        self.sample_args = tuple(sample_args)
        try:
            self.calls = record_calls(self.model, *self.sample_args)
        except Exception as e:  # pylint: disable=broad-except
            raise _checks.sample_refused(e, self.sample_args, built_for(model)) from e
        self._modules = self.model.layers_by_path()
        self._kernels: dict[str, dict[str, str]] = {}
        self._calibration_args: dict[str, list[tuple]] | None = None
        self._calibrated: dict[tuple[str, str], Module] = {}
        self._probe: _nn_first_order.GradientProbe | None = None
        self._runner: _nn_first_order.LayerRunner | None = None
        self._part_outputs: PartOutputs | None = None  # made by the first scoring_model
        self._layers = tuple(self._describe(path) for path, call in self.calls.items()
                             if self._modules[path].tunable)

    def _describe(self, path: str) -> TunableLayer:
        layer, call = self._modules[path], self.calls[path]
        config = _config_without_name(layer)
        signature = json.dumps({"class": type(layer).__name__, "config": config, "weights": shapes_and_dtypes(layer),
                                "inputs": shapes_and_dtypes((call.args, call.kwargs))}, sort_keys=True, default=str)
        first = jax.tree_util.tree_leaves((call.args, call.kwargs))[0]
        # Modes that cannot take this layer's real input (float8 on integer ids) are left out;
        # GPTQ and AWQ (weight-only: float inputs through a float product) take any input.
        modes = tuple(m for m in layer.supported_quantization_modes
                      if policies.get_quantization_mode(m).calibrated
                      or _checks.input_problem(call.args, f"{m}_from_float32") is None)
        from autopolicy.nn.embedding import Embedding  # pylint: disable=import-outside-toplevel

        return TunableLayer(path, type(layer).__name__, modes, signature, tuple(np.shape(first)), call.producer,
                            gather=isinstance(layer, Embedding))

    def layers(self) -> tuple[TunableLayer, ...]:
        return self._layers

    def layer_program(self, path: str, policy: policies.DTypePolicy, kernel: str | None = None) -> Program:
        call = self.calls[path]
        args, kwargs = cast_floating((call.args, call.kwargs), policy.compute_dtype)
        layer = self._layer_under(path, policy)
        if kernel is not None:
            layer = layer.with_kernels({path: kernel})
        return Program(_call_layer, (args, kwargs), layer)

    def layer_kernels(self, path: str, policy: policies.DTypePolicy) -> tuple[str, ...]:
        """The kernels of the layer's product under ``policy`` worth timing on this device
        (:func:`autopolicy.numerics.kernels.candidate_kernels`), default first."""
        mode = policy.quantization_mode
        layer = self._modules[path]
        if mode is None or mode not in layer.supported_quantization_modes:
            return ()
        return kernels.candidate_kernels(mode, layer.kernel_op)

    def use_kernels(self, choice: dict[str, dict[str, str]]) -> None:
        """Every later :meth:`with_policies` runs, per layer, the kernel chosen for its policy."""
        self._kernels = {path: dict(by_policy) for path, by_policy in choice.items()}

    def _layer_under(self, path: str, policy: policies.DTypePolicy) -> Module:
        """The layer under ``policy``; GPTQ/AWQ weights calibrated on its float inputs (cached)."""
        layer = self._modules[path].with_dtype_policy(policy)
        if not _weights_calibrated(policy):
            return layer
        key = (path, policy.name)
        if key not in self._calibrated:
            self._calibrated[key] = calibrate_weights(layer, self._layer_inputs(path), sequential=False)
        return self._calibrated[key]

    def _layer_inputs(self, path: str) -> list[tuple]:
        """The positional arguments ``path`` receives when the float model runs on each
        calibration batch (the sample input when there are none), recorded once for all layers."""
        if self._calibration_args is None:
            recorded: dict[str, list[tuple]] = {}
            for batch in self.calibration or [self.sample_args]:
                batch = batch if isinstance(batch, tuple) else (batch,)
                for p, call in record_calls(self.model, *batch).items():
                    recorded.setdefault(p, []).append(tuple(call.args))
            self._calibration_args = recorded
        if path not in self._calibration_args:
            raise ValueError(f"The calibration batches never reach {path!r}: its GPTQ/AWQ weights cannot be "
                             "calibrated.")
        return self._calibration_args[path]

    def layer_bytes(self, path: str, policy: policies.DTypePolicy) -> int:
        layer = self._modules[path].with_dtype_policy(policy)
        if _weights_calibrated(policy):  # the calibrated form's sizes, without calibrating
            layer = with_calibrated_placeholders(layer, [path])
        return int(layer.nbytes())

    def complete_map(self, assignment: dict[str, policies.DTypePolicy]) -> policies.DTypePolicyMap:
        """Parameter-free layers that consume a retyped layer's output follow its compute dtype."""
        entries: dict[str, Any] = {p: policies.get(n) for p, n in assignment.items() if policies.get(n).name != FLOAT32}
        tunable = {layer.path for layer in self._layers}
        for path, call in self.calls.items():
            if path in tunable or call.producer not in entries:
                continue
            producer = entries[call.producer]
            entries[path] = policies.DTypePolicy(getattr(producer, "source_name", producer.name))
        return policies.DTypePolicyMap(FLOAT32, entries)

    def with_policies(self, policy_map: policies.DTypePolicyMap) -> Module:
        model = self.model.with_dtype_policy(policy_map)
        calibrated = {path: self._layer_under(path, layer.dtype_policy)
                      for path, layer in model.layers_by_path().items() if _weights_calibrated(layer.dtype_policy)}
        if calibrated:
            model = _base.map_modules(model, lambda m: calibrated.get(m.path))
        layers = model.layers_by_path()
        chosen = {path: by_policy[layers[path].dtype_policy.name] for path, by_policy in self._kernels.items()
                  if path in layers and layers[path].dtype_policy.name in by_policy}
        if chosen:
            model = model.with_kernels(chosen)
        if any(layer.quantization_mode == "float8" for layer in model.layers_by_path().values()):
            model = calibrate(model, self.calibration or [self.sample_args])
        return model

    def output_gradients(self, loss_fn: Any, batch: Any) -> OutputGradients:
        """The gradient of ``loss_fn(model, *batch)`` (per-example losses; their mean) with respect
        to every tunable layer's output on the float32 model, with the layers' inputs
        (:class:`~autopolicy.adapters._nn_first_order.GradientProbe`)."""
        if self._probe is None or self._probe.loss_fn is not loss_fn:
            self._probe = _nn_first_order.GradientProbe(self.model, [layer.path for layer in self._layers], loss_fn)
        return self._probe(batch)

    def layer_outputs(self, path: str, policy: policies.DTypePolicy, captured: OutputGradients) -> tuple:
        """The layer at ``path`` under ``policy`` on each of its calls in ``captured``: per call,
        its floating output leaves as float32 (one compilation per layer signature and policy)."""
        if self._runner is None:
            self._runner = _nn_first_order.LayerRunner(self._layer_under, {l.path: l.signature for l in self._layers})
        return self._runner.outputs(path, policy, captured.inputs.get(path, ()))

    def scoring_model(self, model: Module) -> Module:
        """``model`` compiled by parts (:meth:`~autopolicy.nn.Module.compiled_by_parts`): the
        sensitivity scores' models differ from float32 in one layer, so each compiles one new
        part (a block), where a whole-model compilation each compiled them all (MiniLM: 191
        models of six blocks; their outputs equal the whole model's up to rounding). All share
        one :class:`~autopolicy.nn.PartOutputs`: the float32 parts before the changed layer,
        run again on the same batches, return their earlier outputs."""
        if self._part_outputs is None:
            self._part_outputs = PartOutputs()
        return model.compiled_by_parts(reuse=self._part_outputs)

    def model_program(self, model: Module) -> Program:
        # A model compiled by parts has no single program to compile ahead: its parts compile
        # once per signature as it runs.
        return Program(_call_model, self.sample_args, model, compiled=model,
                       lower=None if model.compiles_by_parts else functools.partial(lower_call, model))

    def weights_digest(self) -> str:
        return digest_arrays(self.model)


register_adapter(Module, NNAdapter, "autopolicy.nn.Module")
