"""The seam between the search and a model: what the search needs from any framework's model.

The search never touches a model directly. It asks an adapter for the tunable layers (path,
kind, supported quantization modes, a signature for caching, where each gets its input), for one
layer under one policy as a jittable program on that layer's real input, for the whole model
under a :class:`~autopolicy.policies.DTypePolicyMap` (the object the user's ``eval_fn`` scores)
and as a jittable program, and for a digest of the weights.

Adapters are picked from the model's type: :func:`register_adapter` adds one. The adapters of
``autopolicy.nn`` and Keras 3 are found by the module their model classes come from and imported
only when such a model is tuned, so the search imports no framework itself.

A minimal adapter, for a model that is a plain function of a params dict (any framework works
the same way):

>>> import jax.numpy as jnp
>>> from autopolicy import policies
>>> class Matmul:
...     def __init__(self, w): self.w = w
>>> class MatmulAdapter:
...     def __init__(self, model, sample_args, calibration):
...         self.model, self.x = model, sample_args[0]
...     def layers(self):
...         return (TunableLayer("w", "matmul", (), "matmul-8x4", self.x.shape, None),)
...     def layer_program(self, path, policy):
...         dtype = jnp.dtype(policy.compute_dtype)
...         return Program(lambda w, x: x @ w.astype(x.dtype), (self.x.astype(dtype),), self.model.w)
...     def layer_bytes(self, path, policy):
...         return self.model.w.size * jnp.dtype(policy.variable_dtype).itemsize
...     def complete_map(self, assignment):
...         return policies.DTypePolicyMap("float32", assignment)
...     def with_policies(self, policy_map):
...         dtype = jnp.dtype(policy_map["w"].compute_dtype)
...         return lambda x: (x.astype(dtype) @ self.model.w.astype(dtype)).astype(jnp.float32)
...     def model_program(self, model):
...         return Program(lambda _, x: model(x), (self.x,))
...     def weights_digest(self):
...         return digest_arrays(self.model.w)
>>> register_adapter(Matmul, MatmulAdapter)
>>> adapter = get_adapter(Matmul(jnp.ones((8, 4))), (jnp.ones((2, 8)),), [])
>>> [layer.path for layer in adapter.layers()]
['w']
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import policies
from autopolicy.numerics import _sharding
from autopolicy.search.cache import weights_digest as digest_arrays

__all__ = [
    "TunableLayer",
    "Program",
    "ModelAdapter",
    "AdapterFactory",
    "register_adapter",
    "get_adapter",
    "digest_arrays",
    "KERNEL_METHODS",
    "supports_kernels",
    "OutputGradients",
    "FIRST_ORDER_METHODS",
    "SCORING_METHOD",
    "supports_first_order",
    "cast_floating",
    "shapes_and_dtypes",
]


@dataclasses.dataclass(frozen=True)
class TunableLayer:
    """A layer whose policy the search chooses, as it sits in the model.

    Attributes:
      path: The layer's path (``"encoder/block_0/attention/query"``): the key of the map.
      kind: The layer's kind (its class name), for reports.
      modes: The quantization modes it has kernels for (``("int8", "float8")``).
      signature: What its latency depends on (class, configuration, weight and input shapes
        and dtypes), as text: layers with equal signatures are timed once.
      input_shape: The shape of its first input on the sample input.
      producer: The path of the layer whose output is its first input (tunable or not), or None
        when it reads a model input.
      gather: Whether a call reads only the rows it looks up (an embedding) rather than all its
        weights: no weight-streaming floor applies to its latency.
    """

    path: str
    kind: str
    modes: tuple[str, ...]
    signature: str
    input_shape: tuple[int, ...]
    producer: str | None = None
    gather: bool = False

    def supports(self, policy: policies.DTypePolicy) -> bool:
        """Whether the layer can run ``policy`` (quantized policies need a kernel)."""
        return policy.quantization_mode is None or policy.quantization_mode in self.modes


@dataclasses.dataclass(frozen=True)
class Program:
    """A jittable computation: ``fn(state, *args)``.

    ``state`` (weights) and ``args`` (inputs) are both passed as jit arguments, so weights stay
    runtime values, never compile-time constants.
    """

    fn: Callable[..., Any]
    args: tuple
    state: Any = None
    #: Optional ``compiled(*args)``: the same computation through the framework's own compiled
    #: call (an ``autopolicy.nn`` model called from Python), so that running it shares the
    #: compilation the user's ``eval_fn`` triggers on the same model and shapes.
    compiled: Callable[..., Any] | None = None
    #: Optional ``lower(*args)``: the ``jax.stages.Lowered`` of ``compiled`` on ``args``. Compiling
    #: it (in another thread) ahead of ``run`` leaves ``run`` the compiled program: JAX keeps the
    #: executable for the same lowering.
    lower: Callable[..., Any] | None = None

    def call(self, state: Any, args: tuple) -> Any:
        return self.fn(state, *args)

    def run(self, *args: Any) -> Any:
        """Runs the program compiled, on ``args`` (default: its own)."""
        if self.compiled is not None:
            return self.compiled(*(args or self.args))
        return jax.jit(self.fn)(self.state, *(args or self.args))


@runtime_checkable
class ModelAdapter(Protocol):
    """Everything the search needs from a model, and nothing more.

    An adapter is made by a factory ``factory(model, sample_args, calibration)``: it runs the
    model once on ``sample_args`` (a tuple of positional inputs) to record each tunable layer's
    real input; ``calibration`` (a list of such tuples) is for calibrating scales (float8).
    The user's model is never mutated.
    """

    def layers(self) -> Sequence[TunableLayer]:
        """The tunable layers in execution order (the order of the search's chain)."""

    def layer_program(self, path: str, policy: policies.DTypePolicy) -> Program:
        """The layer at ``path`` under ``policy``, on its recorded input already in the policy's
        compute dtype (what a neighbour of that dtype hands it: the cast is timed apart)."""

    def layer_bytes(self, path: str, policy: policies.DTypePolicy) -> int:
        """The bytes of the layer's weights as stored under ``policy``."""

    def complete_map(self, assignment: dict[str, policies.DTypePolicy]) -> policies.DTypePolicyMap:
        """The map for an assignment of the tunable layers (the rest float32). An adapter may
        add entries for layers that are not tunable (a parameter-free layer that should follow
        its producer's compute dtype, so no cast is inserted)."""

    def with_policies(self, policy_map: policies.DTypePolicyMap) -> Any:
        """A new model (the user's kind: what ``eval_fn`` receives) that runs under the map,
        its scales calibrated where the map needs it."""

    def model_program(self, model: Any) -> Program:
        """A model returned by :meth:`with_policies` as a jittable program on the sample input."""

    def weights_digest(self) -> str:
        """A hash of the model's weights: part of the key of every cached accuracy figure."""


def cast_floating(tree: Any, dtype: str) -> Any:
    """Casts the floating arrays of ``tree`` to ``dtype`` (what autocast does to a layer's input):
    for an adapter's ``layer_program``.

    >>> cast_floating((jnp.ones(2), jnp.arange(2)), "bfloat16")[0].dtype
    dtype(bfloat16)
    """
    target = jnp.dtype(dtype)

    def leaf(x):
        if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x).astype(target)
        return x

    return jax.tree_util.tree_map(leaf, tree)


def shapes_and_dtypes(tree: Any) -> list:
    """``[[shape, dtype], ...]`` of the leaves of ``tree``: part of a layer's signature.

    >>> shapes_and_dtypes({"x": jnp.ones((2, 3))})
    [[[2, 3], 'float32']]
    """
    out = []
    for x in jax.tree_util.tree_leaves(tree):
        entry = [list(np.shape(x)), str(jnp.result_type(x))]
        layout = _sharding.describe(x)  # an array over several devices: its mesh and PartitionSpec
        out.append(entry if layout is None else entry + [layout])
    return out


#: Optional adapter methods for modes with several kernels (tactics); an adapter without them
#: runs each mode's default kernel and the search times one kernel per policy:
#:
#: - ``layer_kernels(path, policy) -> tuple[str, ...]``: the kernels worth timing for the layer
#:   under ``policy`` on this device, its default first (``()``: no choice).
#: - ``layer_program(path, policy, kernel=None)``: the layer's program running ``kernel``.
#: - ``use_kernels(choice)``: ``choice`` maps a layer path to ``{policy name: kernel}``, the
#:   fastest kernel of each policy; every later :meth:`ModelAdapter.with_policies` runs them.
KERNEL_METHODS = ("layer_kernels", "use_kernels")


def supports_kernels(adapter: Any) -> bool:
    """Whether ``adapter`` offers a choice of kernels (:data:`KERNEL_METHODS`)."""
    return all(callable(getattr(adapter, name, None)) for name in KERNEL_METHODS)


@dataclasses.dataclass(frozen=True)
class OutputGradients:
    """A loss's gradient with respect to the output of every call of every tunable layer, on
    one batch of the float32 model (what ``output_gradients`` returns).

    Attributes:
      loss: The loss on the batch: the mean of its per-example losses.
      examples: How many per-example losses that mean is over.
      gradients: ``path -> calls``: per call of the layer (in call order), the gradients of the
        floating leaves of its output (float32, the leaves' shapes, in ``tree_leaves`` order).
      inputs: ``path -> calls``: what each call received, in the adapter's own form (the search
        only hands it back to ``layer_outputs``).
    """

    loss: float
    examples: int
    gradients: Mapping[str, tuple[tuple[Any, ...], ...]]
    inputs: Mapping[str, tuple[Any, ...]]


#: Optional adapter methods for the first-order accuracy estimate
#: (:mod:`autopolicy.search.first_order`); the search uses it only with an adapter that has both:
#:
#: - ``output_gradients(loss_fn, batch) -> OutputGradients``: runs ``loss_fn(model, *batch)``
#:   (per-example losses, their mean is the loss) on the float32 model with a zero added to the
#:   output of every call of every tunable layer, and returns the loss's gradient with respect to
#:   each such zero (the output's gradient), with the inputs of the calls.
#: - ``layer_outputs(path, policy, captured) -> tuple[tuple[Array, ...], ...]``: the layer at
#:   ``path`` under ``policy``, run on the inputs ``captured`` (an :class:`OutputGradients`)
#:   holds for it: per call, the floating leaves of its output, as float32.
FIRST_ORDER_METHODS = ("output_gradients", "layer_outputs")


def supports_first_order(adapter: Any) -> bool:
    """Whether ``adapter`` offers the first-order estimate's methods (:data:`FIRST_ORDER_METHODS`)."""
    return all(callable(getattr(adapter, name, None)) for name in FIRST_ORDER_METHODS)


#: An optional adapter method for the per-layer sensitivity scores
#: (:func:`autopolicy.search.accuracy.measure_accuracy`), which score hundreds of models that
#: differ from float32 in one layer:
#:
#: - ``scoring_model(model) -> model``: ``model`` (from :meth:`ModelAdapter.with_policies`) in the
#:   form those scores run, with the same outputs up to rounding: the ``autopolicy.nn`` adapter's
#:   compiles by parts, so that the blocks such models share compile once
#:   (:meth:`autopolicy.nn.Module.compiled_by_parts`).
SCORING_METHOD = "scoring_model"


AdapterFactory = Callable[[Any, tuple, list], ModelAdapter]

_REGISTRY: list[tuple[Callable[[Any], bool], AdapterFactory, str]] = []
# Adapters shipped with autopolicy, imported when a model's class comes from a module starting
# with the first string (the imported module registers itself).
_BUILTIN = (("autopolicy.nn", "autopolicy.adapters.nn"), ("keras", "autopolicy.adapters.keras"),
            ("flax", "autopolicy.adapters.flax"))


def register_adapter(kind: type | Callable[[Any], bool], factory: AdapterFactory, name: str | None = None) -> None:
    """Makes :func:`autopolicy.search.tune` accept models of ``kind``.

    Args:
      kind: A class (its instances and subclasses' match) or a predicate ``kind(model) -> bool``.
      factory: ``factory(model, sample_args, calibration) -> ModelAdapter``.
      name: For error messages (default: the class's or predicate's name).

    Later registrations take precedence, so a user can replace a built-in adapter.
    """
    if isinstance(kind, type):
        predicate = lambda model, cls=kind: isinstance(model, cls)  # noqa: E731
    elif callable(kind):
        predicate = kind
    else:
        raise TypeError(f"register_adapter takes a class or a predicate. Received: kind={kind!r}")
    if not callable(factory):
        raise TypeError(f"register_adapter needs a callable factory. Received: factory={factory!r}")
    _REGISTRY.insert(0, (predicate, factory, name or getattr(kind, "__name__", repr(kind))))


def _module_chain(model: Any) -> list[str]:
    return [cls.__module__ for cls in type(model).__mro__ if cls is not object]


def _factory_for(model: Any) -> AdapterFactory | None:
    for predicate, factory, _ in _REGISTRY:
        if predicate(model):
            return factory
    return None


def get_adapter(model: Any, sample_args: tuple, calibration: list, adapter: AdapterFactory | None = None) -> ModelAdapter:
    """The adapter for ``model`` (or ``adapter``'s, when given), made on the sample input.

    Raises:
      TypeError: if no adapter is registered for the model's type.
    """
    factory = adapter or _factory_for(model)
    if factory is None:
        modules = _module_chain(model)
        for prefix, module in _BUILTIN:
            if any(m == prefix or m.startswith(prefix + ".") for m in modules):
                importlib.import_module(module)
        factory = _factory_for(model)
    if factory is None:
        known = [name for _, _, name in _REGISTRY] + [m for m, _ in _BUILTIN]
        raise TypeError(
            f"No model adapter for a {type(model).__module__}.{type(model).__qualname__}. Tunable models: "
            f"{sorted(set(known))}; for another kind, pass adapter=... or call "
            "autopolicy.search.register_adapter(ModelClass, factory)."
        )
    made = factory(model, sample_args, calibration)
    missing = [m for m in ("layers", "layer_program", "layer_bytes", "complete_map", "with_policies",
                           "model_program", "weights_digest") if not callable(getattr(made, m, None))]
    if missing:
        raise TypeError(f"The adapter {type(made).__name__} lacks the methods {missing} of ModelAdapter.")
    return made
