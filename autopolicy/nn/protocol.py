"""The small model protocol the search uses, and its implementation for ``autopolicy.nn``.

The search never touches layers directly: it lists the tunable layers with their paths,
records what each receives on a sample input, calls one layer, applies a policy map to get a
new model, and calibrates float8 scales. An adapter with these methods lets it tune models
written with other libraries.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Iterable, Protocol

import jax

from autopolicy import policies
from autopolicy.nn import _context
from autopolicy.nn._module import Module
from autopolicy.nn.calibration import calibrate

__all__ = ["LayerCall", "TunableModel", "NNModel"]


@dataclasses.dataclass
class LayerCall:
    """What one layer received and returned on the sample input (first call only)."""

    path: str
    layer: Any
    args: tuple
    kwargs: dict
    output: Any
    producer: str | None  # the path of the layer whose output this layer consumed, if any


class TunableModel(Protocol):
    """What the search needs from a model."""

    def tunable_layers(self) -> "OrderedDict[str, Any]": ...

    def record_calls(self, *args: Any, **kwargs: Any) -> "OrderedDict[str, LayerCall]": ...

    def layer_with_policy(self, path: str, policy: Any) -> Any: ...

    def with_policies(self, policy_map: policies.DTypePolicyMap) -> Any: ...

    def calibrate(self, model: Any, batches: Iterable[Any]) -> Any: ...


class NNModel:
    """:class:`TunableModel` for an ``autopolicy.nn`` model (a built float model)."""

    def __init__(self, model: Module):
        if not isinstance(model, Module):
            raise TypeError(f"Expected an autopolicy.nn Module. Received: {type(model).__name__}")
        if not model.built:
            raise ValueError("The model must be built: model = model.build(jax.random.key(0), sample_input)")
        quantized = [p for p, m in model.layers_by_path().items() if m.quantization_mode is not None]
        if quantized:
            raise ValueError(
                f"Tune the float model, not a quantized one: {quantized} are already quantized."
            )
        self.model = model.with_dtype_policy("float32")

    def tunable_layers(self) -> "OrderedDict[str, Module]":
        """The leaf layers whose policy matters, in execution order."""
        return OrderedDict((p, m) for p, m in self.model.layers_by_path().items() if m.tunable)

    def record_calls(self, *args: Any, **kwargs: Any) -> "OrderedDict[str, LayerCall]":
        """Runs the float model once and records every leaf layer's first call."""
        leaves = {id(m): p for p, m in self.model.layers_by_path().items()}
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
            self.model(*args, **kwargs)
        return calls

    def layer_with_policy(self, path: str, policy: Any) -> Module:
        layer = self.model.layers_by_path()[path]
        return layer.with_dtype_policy(policy)

    def with_policies(self, policy_map: policies.DTypePolicyMap) -> Module:
        return self.model.with_dtype_policy(policy_map)

    def calibrate(self, model: Module, batches: Iterable[Any]) -> Module:
        return calibrate(model, batches)
