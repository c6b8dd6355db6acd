"""The model adapter for Keras 3 models on the JAX backend (Functional, Sequential, subclassed).

Tunable layers are Keras's leaf layers of a tunable kind (Dense, EinsumDense, the Conv layers,
Embedding, and the query/key/value/output projections of MultiHeadAttention), by
``layer.path``, in the order the sample input calls them. Everything runs Keras's own layer
code: a layer under a policy is a standalone copy of it (``layer.quantize`` for quantized
policies) called statelessly inside ``jax.jit``; a model under a map is a copy made by
:func:`autopolicy.keras.apply_policy_map`'s machinery. The user's model is never modified: the
adapter works on a float32 copy.

Kernel tactics (the optional ``layer_kernels``/``use_kernels`` of the adapter protocol): the
int8 product of a Dense or EinsumDense can run any int8 kernel of this device
(:mod:`autopolicy.adapters._keras_kernels`); Keras's other quantized layers have one kernel.
Float8 is not a candidate for a layer fed integers (an Embedding's ids reaching a Dense), as in
the ``autopolicy.nn`` adapter.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import policies
from autopolicy.adapters import _keras_kernels
from autopolicy.adapters import _keras_models as models
from autopolicy.adapters._keras_layers import (
    attention_projections,
    canonical_name,
    float16_attention_compiles,
    is_tunable,
    keras,
    layer_copy,
    own_policy,
    state_of,
    stateless_fn,
    supported_modes,
    to_keras,
    values,
)
from autopolicy.search import _checks
from autopolicy.search.adapter import (Program, TunableLayer, cast_floating, digest_arrays, register_adapter,
                                       shapes_and_dtypes)

__all__ = ["KerasAdapter", "KerasTunableLayer"]

FLOAT32 = "float32"
_COPIES_KEPT = 8  # standalone layer copies kept for layer_bytes after layer_program


def _signature(layer: Any, call: models.LayerCall) -> str:
    """Class, configuration (without name and policy), weight and input shapes: equal layers of
    different blocks share it and are timed once."""
    config = {k: v for k, v in layer.get_config().items() if k not in ("name", "dtype")}
    weights = [[list(w.shape), str(w.dtype)] for w in layer.weights]
    return json.dumps({"class": type(layer).__name__, "config": config, "weights": weights,
                       "inputs": shapes_and_dtypes((call.args, call.kwargs))}, sort_keys=True, default=str)


@dataclasses.dataclass(frozen=True)
class KerasTunableLayer(TunableLayer):
    """A tunable Keras layer; ``refused_compute_dtypes`` are compute dtypes it cannot run here.

    The query, key and value projections of a MultiHeadAttention refuse float16 on a device
    where Keras's attention core does not compile with float16 operands (XLA on CPU)."""

    refused_compute_dtypes: tuple[str, ...] = ()

    def supports(self, policy: policies.DTypePolicy) -> bool:
        return policy.compute_dtype not in self.refused_compute_dtypes and super().supports(policy)


def _scoped(fn: Any, kernel: str):
    def run(*args):
        with _keras_kernels.kernel_scope(kernel):
            return fn(*args)

    return run


def _model_fn(model: Any):
    call = stateless_fn(model)

    def fn(state, *args):
        return call(state, args, {})

    return fn


class KerasAdapter:
    """:class:`~autopolicy.search.adapter.ModelAdapter` for a built float ``keras.Model``.

    ``sample_args`` are the model's positional arguments: a model with several inputs takes
    them as one list or dict, so pass ``sample_input=([ids, mask],)``.

    Raises:
      TypeError: if ``model`` is not a ``keras.Model``.
      ValueError: if Keras is not on the JAX backend, the model is not built, is already
        quantized, cannot be copied, or fails on the sample input.
    """

    def __init__(self, model: Any, sample_args: tuple, calibration: list):
        models.check_model(model)
        quantized = [layer.path for layer in models.all_layers(model)
                     if getattr(layer, "quantization_mode", None) is not None]
        if quantized:
            raise ValueError(f"Tune the float model, not a quantized one: {quantized} are already quantized.")
        self.sample_args = tuple(sample_args)
        self.calibration = list(calibration) or [self.sample_args]
        self.model = models.copy_model(model, self.sample_args)
        models.apply_policies(self.model, policies.DTypePolicyMap(FLOAT32))
        try:
            self.calls, self.amax = models.record_calls(self.model, [self.sample_args] + [
                b for b in self.calibration if b is not self.sample_args])
        except Exception as e:  # pylint: disable=broad-except
            raise _checks.sample_refused(e, self.sample_args, models.built_for(model)) from e
        projections = attention_projections(self.model)
        self._refused = {} if float16_attention_compiles() else {i: ("float16",) for i in projections}
        self._layers = tuple(self._describe(call) for call in self.calls.values() if is_tunable(call.layer))
        self._copies: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._kernels: dict[str, dict[str, str]] = {}

    def _describe(self, call: models.LayerCall) -> TunableLayer:
        first = jax.tree_util.tree_leaves((call.args, call.kwargs))[0]
        # Modes that cannot take this layer's real input (float8 on integer ids) are left out.
        modes = tuple(m for m in supported_modes(call.layer)
                      if _checks.input_problem(call.args, f"{m}_from_float32") is None)
        return KerasTunableLayer(call.path, type(call.layer).__name__, modes,
                                 _signature(call.layer, call), tuple(np.shape(first)), call.producer,
                                 gather=isinstance(call.layer, keras.layers.Embedding),
                                 refused_compute_dtypes=self._refused.get(id(call.layer), ()))

    def layers(self) -> tuple[TunableLayer, ...]:
        return self._layers

    def _copy(self, path: str, policy: policies.DTypePolicy) -> Any:
        key = (path, policy.name)
        if key not in self._copies:
            self._copies[key] = layer_copy(self.calls[path].layer, to_keras(policy), self.amax.get(path))
            while len(self._copies) > _COPIES_KEPT:
                self._copies.popitem(last=False)
        return self._copies[key]

    def layer_program(self, path: str, policy: policies.DTypePolicy, kernel: str | None = None) -> Program:
        call = self.calls[path]
        args, kwargs = cast_floating((call.args, call.kwargs), policy.compute_dtype)
        layer = self._copy(path, policy)
        fn = stateless_fn(layer)
        if kernel is not None:
            if kernel not in self.layer_kernels(path, policy):
                raise ValueError(f"Invalid kernel for {path!r} under {policy.name!r}. Expected one of "
                                 f"{self.layer_kernels(path, policy)}. Received: kernel={kernel!r}")
            fn = _scoped(fn, kernel)
        return Program(fn, (args, kwargs), state_of(layer))

    def layer_kernels(self, path: str, policy: policies.DTypePolicy) -> tuple[str, ...]:
        """The kernels of the layer's product under ``policy`` worth timing on this device,
        default first; ``()`` where Keras's layer runs one (float8, convolutions, embeddings)."""
        layer = next((t for t in self._layers if t.path == path), None)
        if layer is None or policy.quantization_mode is None or not layer.supports(policy):
            return ()
        return _keras_kernels.layer_kernels(self.calls[path].layer, policy.quantization_mode, layer.input_shape)

    def use_kernels(self, choice: dict[str, dict[str, str]]) -> None:
        """Every later :meth:`with_policies` runs, per layer, the kernel chosen for its policy."""
        self._kernels = {path: dict(by_policy) for path, by_policy in choice.items()}

    def layer_bytes(self, path: str, policy: policies.DTypePolicy) -> int:
        layer = self._copy(path, policy)
        return int(sum(np.prod(v.shape, dtype=np.int64) * jnp.dtype(v.dtype).itemsize for v in layer.weights))

    def complete_map(self, assignment: dict[str, policies.DTypePolicy]) -> policies.DTypePolicyMap:
        """Leaf layers that are not tuned (LayerNormalization) and read a retyped layer's output
        follow its compute dtype, so no cast is inserted between them."""
        entries: dict[str, Any] = {p: policies.get(n) for p, n in assignment.items() if policies.get(n).name != FLOAT32}
        tunable = {layer.path for layer in self._layers}
        for path, call in self.calls.items():
            if path in tunable or call.producer not in entries:
                continue
            producer = entries[call.producer]
            follow = policies.DTypePolicy(getattr(producer, "source_name", None) or producer.name)
            if follow.name != FLOAT32:  # an int8_from_float32 layer hands on float32: nothing to add
                entries[path] = follow
        return policies.DTypePolicyMap(FLOAT32, entries)

    def with_policies(self, policy_map: policies.DTypePolicyMap) -> Any:
        model = models.copy_model(self.model, self.sample_args)
        models.apply_policies(model, policy_map)
        models.calibrate(model, self.amax)
        models.remember(model, policy_map)
        if self._kernels:
            for layer in models.all_layers(model):
                chosen = self._kernels.get(layer.path, {})
                name = getattr(layer, "quantization_mode", None) and canonical_name(own_policy(layer))
                if name in chosen:
                    _keras_kernels.with_kernel(layer, chosen[name])
        return model

    def model_program(self, model: Any) -> Program:
        # Copies: the timer keeps the program across later eval_fn calls, and a model.predict
        # there donates the model's variable buffers to Keras's jitted step.
        return Program(_model_fn(model), self.sample_args, state_of(model, copy=True))

    def weights_digest(self) -> str:
        return digest_arrays(values(self.model))


register_adapter(keras.Model, KerasAdapter, "keras.Model")
