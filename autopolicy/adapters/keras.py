"""The model adapter for Keras 3 models on the JAX backend (Functional, Sequential, subclassed).

Tunable layers are Keras's leaf layers of a tunable kind (Dense, EinsumDense, the Conv layers,
Embedding, and the query/key/value/output projections of MultiHeadAttention), by
``layer.path``, in the order the sample input calls them. Everything runs Keras's own layer
code: a layer under a policy is a standalone copy of it (``layer.quantize`` for quantized
policies) called statelessly inside ``jax.jit``; a model under a map is a copy made by
:func:`autopolicy.keras.apply_policy_map`'s machinery. The user's model is never modified: the
adapter works on a float32 copy.
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
from autopolicy.adapters import _keras_models as models
from autopolicy.adapters._keras_layers import (
    attention_projections,
    float16_attention_compiles,
    is_tunable,
    keras,
    layer_copy,
    state_of,
    stateless_fn,
    supported_modes,
    to_keras,
    values,
)
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
            raise ValueError(f"The model failed on sample_input: {type(e).__name__}: {e}") from e
        projections = attention_projections(self.model)
        self._refused = {} if float16_attention_compiles() else {i: ("float16",) for i in projections}
        self._layers = tuple(self._describe(call) for call in self.calls.values() if is_tunable(call.layer))
        self._copies: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _describe(self, call: models.LayerCall) -> TunableLayer:
        first = jax.tree_util.tree_leaves((call.args, call.kwargs))[0]
        return KerasTunableLayer(call.path, type(call.layer).__name__, supported_modes(call.layer),
                                 _signature(call.layer, call), tuple(np.shape(first)), call.producer,
                                 self._refused.get(id(call.layer), ()))

    def layers(self) -> tuple[TunableLayer, ...]:
        return self._layers

    def _copy(self, path: str, policy: policies.DTypePolicy) -> Any:
        key = (path, policy.name)
        if key not in self._copies:
            self._copies[key] = layer_copy(self.calls[path].layer, to_keras(policy), self.amax.get(path))
            while len(self._copies) > _COPIES_KEPT:
                self._copies.popitem(last=False)
        return self._copies[key]

    def layer_program(self, path: str, policy: policies.DTypePolicy) -> Program:
        call = self.calls[path]
        args, kwargs = cast_floating((call.args, call.kwargs), policy.compute_dtype)
        layer = self._copy(path, policy)
        return Program(stateless_fn(layer), (args, kwargs), state_of(layer))

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
        return model

    def model_program(self, model: Any) -> Program:
        return Program(_model_fn(model), self.sample_args, state_of(model))

    def weights_digest(self) -> str:
        return digest_arrays(values(self.model))


register_adapter(keras.Model, KerasAdapter, "keras.Model")
