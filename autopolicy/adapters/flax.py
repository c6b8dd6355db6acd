"""The model adapter for Flax NNX models: tune an NNX model as it is, export Qwix rules.

Imported only when an NNX model is tuned (``autopolicy.search.tune`` picks it by the model's
class), or as ``autopolicy.adapters.flax``; ``import autopolicy`` never imports Flax.

- Tunable layers are found in execution order by recording the calls of one run on the sample
  input (NNX's ``iter_modules`` order is by attribute name), with paths as Qwix writes them
  (``layers/0/attn/q_proj``).
- Float policies set each module's compute ``dtype``; parameters stay float32 (``param_dtype``
  is set explicitly, as is ``dtype=float32`` on float32 layers: NNX's ``dtype=None`` promotes a
  bfloat16 input with float32 parameters).
- Quantized policies (int8, int4, float8) run through Qwix's PTQ (``qwix.quantize_model`` with
  the rules of :func:`qwix_rules`), so the tuned model is exactly what the exported rules give.
- The user's model is never modified: every variant is a clone.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import qwix

from autopolicy import policies
from autopolicy.adapters._flax_rules import RULE_MODES, qwix_rules, rule_fields, rules_to_json, rules_to_python
from autopolicy.search import _checks
from autopolicy.search.adapter import (Program, TunableLayer, cast_floating, digest_arrays, register_adapter,
                                       shapes_and_dtypes)

__all__ = ["FlaxAdapter", "record_calls", "qwix_rules", "rules_to_json", "rules_to_python", "apply_policy_map",
           "quantized_layer"]

FLOAT32 = policies.DEFAULT_POLICY_NAME

#: Tunable NNX module classes and the quantization modes each runs (through Qwix).
MODES: dict[type, tuple[str, ...]] = {
    nnx.Linear: RULE_MODES,
    nnx.LinearGeneral: RULE_MODES,
    nnx.Einsum: RULE_MODES,
    nnx.Conv: ("int8", "float8"),
    nnx.Embed: (),
    nnx.LayerNorm: (),
    nnx.RMSNorm: (),
    nnx.MultiHeadAttention: (),
}


def _kind(module: Any) -> type | None:
    for cls in type(module).__mro__:
        if cls in MODES:
            return cls
    return None


def _path(keys: tuple) -> str:
    return "/".join(str(k) for k in keys)


class LayerCall:
    """What one tunable module received and returned on the sample input (its first call)."""

    __slots__ = ("path", "module", "args", "kwargs", "output", "producer")

    def __init__(self, path, module, args, kwargs, output, producer):
        self.path, self.module, self.args, self.kwargs = path, module, args, kwargs
        self.output, self.producer = output, producer


def tunable_modules(model: nnx.Module) -> dict[str, nnx.Module]:
    """The tunable modules of ``model`` by path; a module inside a tunable one (the projections of
    a ``MultiHeadAttention``) is tuned on its own, its container only if it has no tunable child."""
    found = {_path(keys): m for keys, m in nnx.iter_modules(model) if keys and _kind(m) is not None}
    return {p: m for p, m in found.items()
            if not any(other.startswith(p + "/") for other in found)}


@contextlib.contextmanager
def _recording(modules: dict[str, nnx.Module], calls: "OrderedDict[str, LayerCall]"):
    by_id = {id(m): p for p, m in modules.items()}
    outputs: dict[int, str] = {}
    originals = {cls: cls.__call__ for cls in {type(m) for m in modules.values()}}

    def wrap(original):
        def call(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            path = by_id.get(id(self))
            if path is not None and path not in calls:
                first = next(iter(jax.tree_util.tree_leaves((args, kwargs))), None)
                producer = outputs.get(id(first)) if first is not None else None
                calls[path] = LayerCall(path, self, args, kwargs, out, producer)
                for leaf in jax.tree_util.tree_leaves(out):
                    outputs[id(leaf)] = path
            return out
        return call

    try:
        for cls, original in originals.items():
            cls.__call__ = wrap(original)
        yield
    finally:
        for cls, original in originals.items():
            cls.__call__ = original


def record_calls(model: nnx.Module, *args: Any) -> "OrderedDict[str, LayerCall]":
    """Runs ``model`` once on ``args`` and records each tunable module's first call, in order."""
    calls: OrderedDict[str, LayerCall] = OrderedDict()
    with _recording(tunable_modules(model), calls):
        model(*args)
    return calls


def _check_model(model: Any) -> None:
    if not isinstance(model, nnx.Module):
        raise TypeError(f"Expected a flax.nnx.Module. Received: {type(model).__name__}")
    from flax import linen  # noqa: PLC0415

    for keys, value in nnx.graph.iter_graph(model):
        if isinstance(value, linen.Module):
            raise TypeError(f"The NNX model holds a Linen module at {_path(keys)!r} ({type(value).__name__}): tune "
                            "pure NNX models (wrap Linen code with flax.nnx.bridge.ToNNX and call it once first).")


def _set_dtypes(model: nnx.Module, paths: dict[str, Any]) -> None:
    """Sets the compute ``dtype`` (and float32 ``param_dtype``) of the modules at ``paths``."""
    modules = dict((_path(k), m) for k, m in nnx.iter_modules(model))
    for path, dtype in paths.items():
        _retype(modules[path], dtype)


def _retype(module: nnx.Module, dtype: Any) -> None:
    """Sets ``dtype`` (and float32 ``param_dtype``) on ``module`` and its submodules."""
    for _, m in nnx.iter_modules(module):
        if hasattr(m, "dtype"):
            m.dtype = jnp.dtype(dtype)
        if hasattr(m, "param_dtype"):
            m.param_dtype = jnp.float32


def _compute_dtype(policy: policies.DTypePolicy) -> str:
    return policies.get(getattr(policy, "source_name", policy.name)).compute_dtype


def _check_mode(path: str, module: nnx.Module, policy: policies.DTypePolicy) -> None:
    """Raises ValueError naming the layer and the policy if the layer cannot run it through Qwix."""
    mode, modes = policy.quantization_mode, MODES[_kind(module)]
    if mode is not None and mode not in modes:
        why = (" (Qwix quantizes a convolution's inputs and weights to one type: no int4 or weight-only rule)"
               if _kind(module) is nnx.Conv else "")
        raise ValueError(f"The layer {path!r} ({type(module).__name__}) cannot run {policy.name!r}{why}. Give it "
                         f"a policy of its quantization modes {modes} or a float policy.")


def apply_policy_map(model: nnx.Module, policy_map: Any, *sample_args: Any) -> nnx.Module:
    """A new NNX model running under ``policy_map`` (the user's model is untouched).

    Float policies set the modules' compute dtype; quantized ones go through Qwix PTQ with the
    rules of :func:`qwix_rules`, which needs ``sample_args`` (one call of the model).

    Raises:
      ValueError: for a map key that is not a tunable layer of the model, a policy a layer
        cannot run, or a rule Qwix leaves unused.
    """
    _check_model(model)
    modules = tunable_modules(model)
    entries = dict(policy_map.items()) if hasattr(policy_map, "items") else dict(policy_map)
    missing = sorted(set(entries) - set(modules))
    if missing:
        raise ValueError(f"The map names layers the model lacks: {missing}. Its tunable layers: {sorted(modules)}")
    entries = {p: policies.get(v) for p, v in entries.items()}
    for path, policy in entries.items():
        _check_mode(path, modules[path], policy)
    tuned = nnx.clone(model)
    _set_dtypes(tuned, {p: _compute_dtype(entries.get(p, policies.get(FLOAT32))) for p in modules})
    rules = qwix_rules({p: v for p, v in entries.items() if v.quantization_mode is not None})
    if not rules:
        return tuned
    if not sample_args:
        raise ValueError("Quantized policies need sample_args: Qwix quantizes a model by calling it once.")
    provider = qwix.PtqProvider(rules)
    tuned = _quantize(tuned, provider, *sample_args)
    unused = provider.get_unused_rules()
    if unused:
        raise ValueError(f"Qwix left rules unused (no op of those layers was quantized): "
                         f"{[r.module_path for r in unused]}")
    return tuned


def quantized_layer(model: nnx.Module, path: str, policy: Any, *sample_args: Any, **sample_kwargs: Any) -> nnx.Module:
    """The layer at ``path`` of the float ``model``, alone, running ``policy``: a module that can be
    called directly (on inputs like ``sample_args``).

    A layer of a model from :func:`apply_policy_map` cannot be: Qwix quantizes the ops inside the
    model's own call, so ``tuned.layer(x)`` meets Qwix's quantized parameters outside it (Qwix 0.1.8:
    ``ValueError: setting an array element with a sequence``). This quantizes the layer as the
    tuned model runs it (the same rule, matched at the layer's root); it is how the tuner times one.

    Raises:
      ValueError: naming ``path`` if it is not a tunable layer of ``model``, or ``policy`` if the
        layer cannot run it.
    """
    _check_model(model)
    modules = tunable_modules(model)
    if path not in modules:
        raise ValueError(f"{path!r} is not a tunable layer of the model: pass a path of the float model, one of "
                         f"{sorted(modules)}")
    policy = policies.get(policy)
    _check_mode(path, modules[path], policy)
    module = nnx.clone(modules[path])
    _retype(module, _compute_dtype(policy))
    fields = rule_fields("", policy)
    if fields is None:
        return module
    if not sample_args and not sample_kwargs:
        raise ValueError(f"Quantizing {path!r} to {policy.name!r} needs sample_args: Qwix quantizes a module by "
                         "calling it once.")
    rule = qwix.QuantizationRule(**{**fields, "module_path": ".*", "weight_qtype": jnp.dtype(fields["weight_qtype"]),
                                    "act_qtype": jnp.dtype(fields["act_qtype"])})
    return _quantize(module, qwix.PtqProvider([rule]), *sample_args, **sample_kwargs)


def _quantize(model: nnx.Module, provider: Any, *args: Any, **kwargs: Any) -> nnx.Module:
    """``qwix.quantize_model``, quiet about the deprecated NNX method Qwix 0.1.8 calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The 'm.iter_modules\(\)' method is deprecated")
        return qwix.quantize_model(model, provider, *args, **kwargs)


def _call_module(state: Any, graphdef: Any, args: tuple, kwargs: dict) -> Any:
    return nnx.merge(graphdef, state)(*args, **kwargs)


def detached(model: nnx.Module) -> nnx.Module:
    """A clone of ``model`` whose arrays are copies (``nnx.clone`` shares them): an ``eval_fn``
    that donates a model's state (``nnx.jit(..., donate_argnums=0)``) then deletes only its own
    model's arrays, never the user's, the adapter's float model or a timed program's."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree_util.tree_map(lambda a: a.copy() if hasattr(a, "copy") else a, state))


def _feature_sizes(model: nnx.Module, most: int = 4) -> str | None:
    """What the model's layers take, for an error message: ``"whose layers take b_first: 16
    features, ..."`` (None when none says)."""
    sizes = [f"{path}: {module.in_features} features" for path, module in tunable_modules(model).items()
             if isinstance(getattr(module, "in_features", None), int)]
    if not sizes:
        return None
    more = f", ... ({len(sizes) - most} more)" if len(sizes) > most else ""
    return "whose layers take " + ", ".join(sizes[:most]) + more


def _nbytes(state: Any) -> int:
    total = 0
    for leaf in jax.tree_util.tree_leaves(state):
        dtype = jnp.dtype(leaf.dtype)
        bits = 4 if dtype.name in ("int4", "uint4") else 8 * dtype.itemsize
        total += (int(np.prod(leaf.shape)) * bits + 7) // 8
    return total


class FlaxAdapter:
    """:class:`~autopolicy.search.adapter.ModelAdapter` for a Flax NNX model.

    Raises:
      TypeError: if ``model`` is not an NNX module, or holds Linen modules.
      ValueError: if it fails on the sample input or has no tunable layer.
    """

    def __init__(self, model: nnx.Module, sample_args: tuple, calibration: list):
        _check_model(model)
        self.model = detached(model)
        self.sample_args = tuple(sample_args)
        self.calibration = list(calibration)
        try:
            self.calls = record_calls(self.model, *self.sample_args)
        except Exception as e:  # pylint: disable=broad-except
            raise _checks.sample_refused(e, self.sample_args, _feature_sizes(self.model)) from e
        if not self.calls:
            raise ValueError(f"The NNX model has no tunable layer called on sample_input. Tunable classes: "
                             f"{sorted(c.__name__ for c in MODES)}")
        self._layers = tuple(self._describe(path) for path in self.calls)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(self.calls)

    def _describe(self, path: str) -> TunableLayer:
        call = self.calls[path]
        module = call.module
        graphdef, state = nnx.split(module)
        signature = json.dumps({"class": type(module).__name__, "config": repr(graphdef),
                                "weights": shapes_and_dtypes(state),
                                "inputs": shapes_and_dtypes((call.args, call.kwargs))}, sort_keys=True, default=str)
        first = jax.tree_util.tree_leaves((call.args, call.kwargs))[0]
        modes = tuple(m for m in MODES[_kind(module)] if _checks.input_problem(call.args, f"{m}_from_float32") is None)
        return TunableLayer(path, type(module).__name__, modes, signature, tuple(np.shape(first)), call.producer,
                            gather=isinstance(module, nnx.Embed))

    def layers(self) -> tuple[TunableLayer, ...]:
        return self._layers

    def _variant(self, path: str, policy: policies.DTypePolicy) -> tuple[nnx.Module, tuple, dict]:
        call = self.calls[path]
        args, kwargs = cast_floating((call.args, call.kwargs), _compute_dtype(policy))
        module = nnx.clone(call.module)
        _retype(module, _compute_dtype(policy))
        fields = rule_fields("", policy) if policy.quantization_mode is not None else None
        if fields is not None:
            rule = qwix.QuantizationRule(**{**fields, "module_path": ".*", "weight_qtype": jnp.dtype(
                fields["weight_qtype"]), "act_qtype": jnp.dtype(fields["act_qtype"])})
            module = _quantize(module, qwix.PtqProvider([rule]), *args, **kwargs)
        return module, args, kwargs

    def layer_program(self, path: str, policy: policies.DTypePolicy) -> Program:
        module, args, kwargs = self._variant(path, policies.get(policy))
        graphdef, state = nnx.split(module)
        return Program(lambda st, a, k: _call_module(st, graphdef, a, k), (args, kwargs), state)

    def layer_bytes(self, path: str, policy: policies.DTypePolicy) -> int:
        module, _, _ = self._variant(path, policies.get(policy))
        return _nbytes(nnx.state(module))

    def complete_map(self, assignment: dict[str, policies.DTypePolicy]) -> policies.DTypePolicyMap:
        entries = {p: policies.get(n) for p, n in assignment.items() if policies.get(n).name != FLOAT32}
        return policies.DTypePolicyMap(FLOAT32, entries)

    def with_policies(self, policy_map: policies.DTypePolicyMap) -> nnx.Module:
        return detached(apply_policy_map(self.model, dict(policy_map.items()), *self.sample_args))

    def model_program(self, model: nnx.Module) -> Program:
        graphdef, state = nnx.split(detached(model))  # the timer keeps it across eval_fn's calls
        return Program(lambda st, *a: nnx.merge(graphdef, st)(*a), self.sample_args, state)

    def weights_digest(self) -> str:
        return digest_arrays(nnx.state(self.model))

    def float_structure(self) -> tuple[Any, Any]:
        """The float model's ``(graphdef, abstract state)``: what a saved tuned model is rebuilt
        from (:func:`autopolicy.load_tuned`)."""
        graphdef, state = nnx.split(self.model)
        return graphdef, jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)


register_adapter(nnx.Module, FlaxAdapter, "flax.nnx.Module")
