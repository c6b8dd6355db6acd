"""The module base: immutable pytrees with Keras-like construction, names, paths and policies.

A module's arrays and submodules are pytree children; everything else (its name, path, dtype
policy, configuration) is static. A module is frozen once its ``__init__`` returns: a change (a
new policy, quantized weights, trained parameters) returns a new module. Names are given by the
parent: an unnamed child is named after its attribute (``self.query = ...`` -> ``query``) or,
inside a list, after its class (``dense``, ``dense_1``, ...).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections import OrderedDict
from typing import Any, Callable, ClassVar, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import policies
from autopolicy.nn import _config, _context
from autopolicy.nn._frozen_map import FrozenPolicyMap
from autopolicy.policies import DTypePolicy, DTypePolicyMap

__all__ = ["Module", "Layer", "is_module"]

logger = logging.getLogger("autopolicy.nn")

_INFER = "infer"
_BOOKKEEPING = ("_frozen", "_child_names")
_X64_DTYPES = ("float64", "int64", "uint64")


def is_module(x: Any) -> bool:
    return isinstance(x, Module)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _is_dynamic(value: Any) -> bool:
    """Arrays, modules and containers holding them are pytree children; the rest is static."""
    if _is_array(value) or isinstance(value, Module):
        return True
    if value is None or isinstance(value, (str, int, float, bool, DTypePolicy, FrozenPolicyMap)):
        return False
    leaves = jax.tree_util.tree_leaves(value, is_leaf=is_module)
    return any(_is_array(leaf) or isinstance(leaf, Module) for leaf in leaves)


def _snake_case(name: str) -> str:
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()


def _dedupe(base: str, used: set[str]) -> str:
    if base not in used:
        return base
    i = 1
    while f"{base}_{i}" in used:
        i += 1
    return f"{base}_{i}"


class _ModuleMeta(type):
    """Runs ``__init__``, then names the children, hands down the dtype and freezes."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = cls.__new__(cls)
        object.__setattr__(obj, "_frozen", False)
        obj.__init__(*args, **kwargs)
        if "name" not in obj.__dict__:
            raise TypeError(
                f"{cls.__name__}.__init__ must call super().__init__(name=..., dtype=...) first."
            )
        # How it was made, for save/load (None when an argument has no JSON form).
        object.__setattr__(obj, "_config", _config.encode_call(cls, args, kwargs))
        obj._adopt_children()
        obj._freeze()
        return obj


class Module(metaclass=_ModuleMeta):
    """Base class of every layer and model.

    Subclass it like a Keras layer: create sublayers in ``__init__``, create weights in
    ``build_variables`` with :meth:`add_weight`, compute in ``call``. Arguments of ``__call__``
    that are floating-point arrays are cast to the compute dtype first (``autocast=False``
    turns this off); weights are read in the compute dtype inside ``call``.

    Args:
      name: The module's name within its parent; None gives it one.
      dtype: A policy, a policy name, a config dict, a ``DTypePolicyMap`` (the module's policy
        is then ``map[module.path]``), or None for the global policy at construction. A
        container given a dtype hands it to the children that were not given one.
      autocast: Whether floating inputs are cast to the compute dtype.

    Example: a pre-norm residual transformer block.

    >>> import autopolicy.nn as nn
    >>> class Block(nn.Module):
    ...     def __init__(self, dim, heads, **kwargs):
    ...         super().__init__(**kwargs)
    ...         self.norm1 = nn.LayerNormalization()
    ...         self.attention = nn.MultiHeadAttention(heads, dim // heads)
    ...         self.norm2 = nn.LayerNormalization()
    ...         self.mlp = nn.Sequential([nn.Dense(4 * dim, activation="gelu"), nn.Dense(dim)])
    ...
    ...     def call(self, x):
    ...         h = self.norm1(x)
    ...         x = x + self.cast(self.attention(h, h))
    ...         return x + self.cast(self.mlp(self.norm2(x)))
    >>> block = Block(32, 4, name="block").build(jax.random.key(0), jnp.ones((2, 8, 32)))
    >>> block(jnp.ones((2, 8, 32))).shape
    (2, 8, 32)
    >>> list(block.layers_by_path())[:3]
    ['block/norm1', 'block/attention/query', 'block/attention/key']
    """

    default_name: ClassVar[str | None] = None
    supported_quantization_modes: ClassVar[tuple[str, ...]] = ()
    #: Leaf layers whose policy changes their cost or accuracy (the search retypes these).
    tunable: ClassVar[bool] = False

    def __init__(self, *, name: str | None = None, dtype: Any = None, autocast: bool = True):
        auto = name is None
        if auto:
            name = type(self)._class_default_name()
        elif not isinstance(name, str) or not name or "/" in name:
            raise ValueError(
                f"A module name is a non-empty string without '/'. Received: name={name!r}"
            )
        if not isinstance(autocast, bool):
            raise TypeError(f"autocast must be a bool. Received: autocast={autocast!r}")
        self.name = name
        self.path = name
        self.autocast = autocast
        self._auto_named = auto
        self._dtype_explicit = dtype is not None
        self._policy_source = _policy_source(dtype)
        self._own_built = type(self).build_variables is Module.build_variables
        self._weights_mode = None
        self._nontrainable: tuple[str, ...] = ()
        self._no_autocast: tuple[str, ...] = ()
        self._regularizers: tuple[tuple[str, Any], ...] = ()
        self._call_order: tuple[str, ...] = ()

    @classmethod
    def _class_default_name(cls) -> str:
        return cls.default_name or _snake_case(cls.__name__)

    # --- immutability -------------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", True):
            raise AttributeError(
                f"{type(self).__name__} {self.__dict__.get('path', '')!r} is immutable; methods such "
                "as with_dtype_policy() and quantize() return a changed copy."
            )
        if isinstance(value, list):
            value = tuple(value)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _attrs(self) -> Iterator[tuple[str, Any]]:
        for key, value in self.__dict__.items():
            if key not in _BOOKKEEPING:
                yield key, value

    def _freeze(self) -> None:
        child_names = []
        for key, value in self._attrs():
            if _is_dynamic(value):
                child_names.append(key)
                continue
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"Attribute {key!r} of {type(self).__name__} holds {type(value).__name__} "
                    f"{value!r}: attributes that are not arrays or modules are static "
                    "configuration and must be hashable (use a tuple, not a list or dict)."
                ) from None
        object.__setattr__(self, "_child_names", tuple(child_names))
        object.__setattr__(self, "_frozen", True)

    def _copy(self, mutable: bool = False, **changes: Any) -> "Module":
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        new.__dict__["_frozen"] = False
        if not mutable:
            new._freeze()
        return new

    # --- pytree -------------------------------------------------------------------------------

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_with_keys(cls, _flatten_with_keys, _unflatten(cls), _flatten)
        cls._call_takes_training = "training" in inspect.signature(cls.call).parameters
        if cls.__module__.startswith("autopolicy."):
            _config.register(cls)

    # --- children, names and paths -------------------------------------------------------------

    def _child_items(self) -> list[tuple[str, bool, "Module"]]:
        """(attribute, is the attribute itself the module, module) for every direct child."""
        items = []
        for key, value in self._attrs():
            if isinstance(value, Module):
                items.append((key, True, value))
            elif _is_dynamic(value):
                for leaf in jax.tree_util.tree_leaves(value, is_leaf=is_module):
                    if isinstance(leaf, Module):
                        items.append((key, False, leaf))
        return items

    def children(self) -> list["Module"]:
        """The direct submodules, in the order they were first called (then definition order)."""
        kids = [m for _, _, m in self._child_items()]
        order = {name: i for i, name in enumerate(self._call_order)}
        return sorted(kids, key=lambda m: order.get(m.name, len(order)))

    def _adopt_children(self, only_new: bool = False) -> None:
        """Names the direct children uniquely and sets paths in their subtrees (copying them).

        With ``only_new``, only children created since the last adoption (while building, e.g.
        a projection whose size depends on the input) are named; the others keep theirs.
        """
        items = self._child_items()
        prefix = self.path + "/"
        adopted = {id(m) for _, _, m in items if only_new and m.path.startswith(prefix)}
        explicit = [m.name for _, _, m in items if not m._auto_named or id(m) in adopted]
        duplicates = sorted({n for n in explicit if explicit.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"Names of the children of {self.path!r} must be unique. Duplicated: {duplicates}"
            )
        used = set(explicit)
        mutable = not self.__dict__.get("_frozen", True) and _context.build_state() is not None
        renamed: dict[int, Module] = {}
        for attr, single, child in items:
            if id(child) in renamed or id(child) in adopted:
                continue
            if child._auto_named:
                base = attr.lstrip("_") if single else type(child)._class_default_name()
                name = _dedupe(base or type(child)._class_default_name(), used)
            else:
                name = child.name
            used.add(name)
            renamed[id(child)] = child._with_path(
                name, prefix + name, self._inherited(), freeze=not mutable
            )
        if not renamed:
            return

        def swap(x):
            return renamed.get(id(x), x) if isinstance(x, Module) else x

        for key, value in list(self._attrs()):
            if isinstance(value, Module) or (_is_dynamic(value) and not _is_array(value)):
                object.__setattr__(self, key, jax.tree_util.tree_map(swap, value, is_leaf=is_module))

    def _inherited(self) -> Any:
        """The policy source this module hands to children that were not given a dtype."""
        return self._policy_source if self._dtype_explicit else None

    def _with_path(
        self, name: str, path: str, inherited: Any = None, freeze: bool = True
    ) -> "Module":
        changes: dict[str, Any] = {"name": name, "path": path}
        if inherited is not None and not self._dtype_explicit:
            changes["_policy_source"] = inherited
        new = self._copy(mutable=True, **changes)
        own = new._inherited()
        handed_down = own if own is not None else (None if self._dtype_explicit else inherited)

        def repath(x):
            if isinstance(x, Module):
                return x._with_path(x.name, f"{path}/{x.name}", handed_down, freeze)
            return x

        for key, value in list(new._attrs()):
            if isinstance(value, Module) or (_is_dynamic(value) and not _is_array(value)):
                object.__setattr__(new, key, jax.tree_util.tree_map(repath, value, is_leaf=is_module))
        if freeze:
            new._freeze()
        return new

    def modules(self) -> "OrderedDict[str, Module]":
        """Every module of the tree (this one first) by path, parents before children."""
        out: OrderedDict[str, Module] = OrderedDict()

        def visit(m: Module) -> None:
            out[m.path] = m
            for child in m.children():
                visit(child)

        visit(self)
        return out

    def layers_by_path(self) -> "OrderedDict[str, Module]":
        """The leaf layers by path, in execution order (as recorded when the model was built).

        >>> import autopolicy.nn as nn
        >>> mlp = nn.Sequential([nn.Dense(8), nn.Dense(2)], name="mlp")
        >>> list(mlp.layers_by_path())
        ['mlp/dense', 'mlp/dense_1']
        """
        return OrderedDict((p, m) for p, m in self.modules().items() if not m.children())

    # --- policies -------------------------------------------------------------------------------

    @property
    def dtype_policy(self) -> DTypePolicy:
        """The policy this module runs under (a quantized policy it has no kernel for is read
        as its source policy)."""
        source = self._policy_source
        if source == _INFER:
            raise RuntimeError(
                f"{self.path!r} uses the 'infer' policy and takes its dtype from its first input: "
                "build it first."
            )
        policy = source.lookup(self.path) if isinstance(source, FrozenPolicyMap) else source
        mode = policy.quantization_mode
        if mode is not None and mode not in self.supported_quantization_modes:
            return DTypePolicy(policy.source_name)
        return policy

    @property
    def compute_dtype(self) -> str:
        return self.dtype_policy.compute_dtype

    @property
    def variable_dtype(self) -> str:
        return self.dtype_policy.variable_dtype

    @property
    def quantization_mode(self) -> str | None:
        return self.dtype_policy.quantization_mode

    def cast(self, x: Any) -> Any:
        """Casts the floating-point arrays in ``x`` to this module's compute dtype."""
        dtype = jnp.dtype(self.compute_dtype)

        def leaf(a):
            if _is_array(a) and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype:
                return a.astype(dtype)
            return a

        return jax.tree_util.tree_map(leaf, x)

    def with_dtype_policy(self, policy: Any, strict: bool = False) -> "Module":
        """Returns a copy in which every module's policy is ``policy`` or ``map[module.path]``.

        Built layers convert their weights: cast to the new variable dtype, quantized for an
        int8 policy, given float8 scaling state for a float8 policy. A quantized policy for a
        layer with no such kernel (a LayerNormalization) leaves it on the source policy.

        Args:
          policy: A policy, name, config dict or ``DTypePolicyMap``.
          strict: Raise if a key of the map matches no module path (a typo).

        Raises:
          ValueError: for an invalid policy, or unused keys when ``strict``.
        """
        resolved = policies.get(policy)
        if isinstance(resolved, DTypePolicyMap):
            if strict:
                unused = resolved.unused_keys(self.modules().keys())
                if unused:
                    raise ValueError(
                        f"Keys of the DTypePolicyMap match no layer path: {unused}. "
                        f"Paths are: {list(self.modules())}"
                    )
            lookup: Callable[[str], DTypePolicy] = resolved.__getitem__
        else:
            lookup = lambda path: resolved  # noqa: E731
        skipped: list[str] = []
        new = self._retyped(lookup, skipped)
        if skipped:
            logger.info("kept the source policy for layers without a quantized kernel: %s", skipped)
        return new

    def quantize(self, mode: str, filter: Callable[[str, "Module"], bool] | None = None) -> "Module":  # noqa: A002
        """Returns a copy whose layers run ``mode`` (``"int8"`` or ``"float8"``) kernels.

        On a single layer, a layer type without such a kernel, an unbuilt layer or an already
        quantized one raise. On a model, layers without such a kernel are skipped (and logged);
        ``filter(path, layer)`` selects the layers to quantize.

        Raises:
          ValueError: for an invalid mode, an already quantized layer, or a layer type without a
            kernel for ``mode`` (single layer), or a float16 compute dtype for int8.
          RuntimeError: if the module is not built.
        """
        if mode not in policies.QUANTIZATION_MODES:
            raise ValueError(
                f"Invalid quantization mode. Expected one of {policies.QUANTIZATION_MODES}. "
                f"Received: mode={mode!r}"
            )
        if not self.built:
            raise RuntimeError(
                f"{type(self).__name__} {self.path!r} is not built; quantize converts built weights: "
                "call model.build(key, sample_input) first."
            )
        single = not self.children()
        targets: dict[str, DTypePolicy] = {}
        skipped = []
        for path, layer in self.layers_by_path().items():
            if filter is not None and not filter(path, layer):
                continue
            if mode not in layer.supported_quantization_modes:
                if single:
                    raise ValueError(
                        f"{type(layer).__name__} {path!r} has no {mode} kernel: "
                        f"{type(layer).__name__} supports the quantization modes "
                        f"{layer.supported_quantization_modes}."
                    )
                skipped.append(path)
                continue
            current = layer.dtype_policy
            if current.quantization_mode is not None:
                raise ValueError(f"{path!r} is already quantized (policy {current.name!r}).")
            try:
                targets[path] = policies.get(f"{mode}_from_{current.name}")
            except ValueError as e:
                raise ValueError(f"Cannot quantize {path!r}: {e}") from None
        unchanged = {p: m.dtype_policy for p, m in self.modules().items()}
        new = self._retyped(lambda p: targets.get(p, unchanged[p]), [])
        if skipped:
            logger.warning("quantize(%r) skipped layers without such a kernel: %s", mode, skipped)
        return new

    def _retyped(self, lookup: Callable[[str], DTypePolicy], skipped: list[str]) -> "Module":
        policy = lookup(self.path)
        new = self._copy(mutable=True, _policy_source=policy, _dtype_explicit=True)
        mode = policy.quantization_mode
        if mode is not None and mode not in self.supported_quantization_modes and not self.children():
            skipped.append(self.path)

        def retype(x):
            return x._retyped(lookup, skipped) if isinstance(x, Module) else x

        for key, value in list(new._attrs()):
            if isinstance(value, Module) or (_is_dynamic(value) and not _is_array(value)):
                object.__setattr__(new, key, jax.tree_util.tree_map(retype, value, is_leaf=is_module))
        if self._own_built and type(self).build_variables is not Module.build_variables:
            new._convert_weights(self)
        new._freeze()
        return new

    def _convert_weights(self, old: "Module") -> None:
        """Converts the weights of this (mutable, just retyped) copy from ``old``'s policy.

        The base version casts float variables to the new variable dtype; quantizable layers
        extend it.
        """
        variable = jnp.dtype(self.variable_dtype)
        for key, value in list(self._attrs()):
            if (
                key in self._child_names_now()
                and _is_array(value)
                and jnp.issubdtype(value.dtype, jnp.floating)
                and key not in self._no_autocast
                and value.dtype != variable
            ):
                object.__setattr__(self, key, jnp.asarray(value).astype(variable))

    def _child_names_now(self) -> tuple[str, ...]:
        return tuple(k for k, v in self._attrs() if _is_dynamic(v))

    # --- building ----------------------------------------------------------------------------

    @property
    def built(self) -> bool:
        return self._own_built and all(c.built for c in self.children())

    def build(self, key: jax.Array, *sample_args: Any, **sample_kwargs: Any) -> "Module":
        """Returns a built copy: every layer creates its weights from its real input shapes.

        Args:
          key: A ``jax.random.key``; each layer derives its own from it and its path.
          *sample_args, **sample_kwargs: Inputs to run the model on once (any batch size).

        Raises:
          TypeError: if ``key`` is not a PRNG key.
          RuntimeError: if some layers were never called by the model.
        """
        _check_key(key)
        spec = _input_spec(sample_args, sample_kwargs)
        own_leaves, own_treedef = jax.tree_util.tree_flatten(self)
        input_leaves, input_treedef = jax.tree_util.tree_flatten((sample_args, sample_kwargs))
        traced = [i for i, leaf in enumerate(input_leaves) if _is_array(leaf)]
        state = _context.BuildState(key)
        result: dict[str, Any] = {}

        # The pass that discovers shapes runs traced, with zero placeholders for new weights:
        # it compiles to little more than the placeholders. Weights are drawn afterwards.
        def build_pass(own, arrays):
            inputs = list(input_leaves)
            for i, value in zip(traced, arrays):
                inputs[i] = value
            args, kwargs = jax.tree_util.tree_unflatten(input_treedef, inputs)
            work = _mutable_tree(jax.tree_util.tree_unflatten(own_treedef, own))
            with _context.building(state):
                work(*args, **kwargs)
            object.__setattr__(work, "_build_spec", spec)
            _freeze_tree(work)
            result["unbuilt"] = [p for p, m in work.modules().items() if not m._own_built]
            leaves, result["treedef"] = jax.tree_util.tree_flatten(work)
            placeholders = {id(p): i for i, (p, _) in enumerate(state.requests)}
            result["requests"] = [(j, placeholders[id(x)]) for j, x in enumerate(leaves) if id(x) in placeholders]
            return leaves

        leaves = list(jax.jit(build_pass)(own_leaves, [input_leaves[i] for i in traced]))
        if result["unbuilt"]:
            raise RuntimeError(
                f"These layers were never called while building, so have no weights: {result['unbuilt']}"
            )
        from autopolicy.nn import initializers  # pylint: disable=import-outside-toplevel

        for leaf_index, request_index in result["requests"]:
            leaves[leaf_index] = initializers.draw(key, **state.requests[request_index][1])
        built = jax.tree_util.tree_unflatten(result["treedef"], leaves)
        return _map_modules(built, lambda m: m._finish_build())

    def _finish_build(self) -> "Module | None":
        """Value-dependent conversions once weights are real (quantizing); None if nothing."""
        return None

    def build_variables(self, *args: Any, **kwargs: Any) -> None:
        """Creates the weights from the first (autocast) inputs. Leaf layers override this."""

    def add_weight(
        self,
        name: str,
        shape: tuple[int, ...],
        initializer: Any,
        dtype: Any = None,
        trainable: bool = True,
        autocast: bool = True,
        regularizer: Any = None,
        fan_axes: tuple[Any, Any] = (-2, -1),
    ) -> jax.Array:
        """Creates a weight in ``build_variables``, stored in the variable dtype.

        Args:
          name: The attribute to store it in.
          shape: Its shape.
          initializer: A name (``"glorot_uniform"``) or ``fn(key, shape, dtype)``.
          dtype: Overrides the variable dtype.
          trainable: False for state that optimizers must not touch.
          autocast: False keeps it in its own dtype inside ``call`` (normalization statistics).
          regularizer: A regularizer applied to the stored value (``nn.regularizers.L2(1e-4)``).
          fan_axes: ``(in_axis, out_axis)`` for variance-scaling initializers.
        """
        state = _context.build_state()
        if state is None:
            raise RuntimeError("add_weight() is only available while the model is being built.")
        dtype = jnp.dtype(dtype or self.variable_dtype)
        placeholder = jnp.zeros(tuple(shape), dtype)
        request = {"path": f"{self.path}/{name}", "shape": tuple(shape), "dtype": dtype,
                   "initializer": initializer, "fan_axes": fan_axes}
        state.requests.append((placeholder, request))
        setattr(self, name, placeholder)
        if not trainable:
            self._nontrainable = self._nontrainable + (name,)
        if not autocast:
            self._no_autocast = self._no_autocast + (name,)
        if regularizer is not None:
            self._regularizers = self._regularizers + ((name, regularizer),)
        return placeholder

    def _after_build(self) -> None:
        """Hook run on the mutable copy once ``build_variables`` returned (quantize, adopt)."""
        self._adopt_children(only_new=True)

    # --- calling -----------------------------------------------------------------------------

    def call(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement call()")

    def __call__(self, *args: Any, training: bool | None = None, **kwargs: Any) -> Any:
        if _compiles_top_level_call(self, args, kwargs):
            return _jit_call(self, args, kwargs, training=bool(training))
        if training is None:
            training = _context.inherited_training()
        parent = _context.caller()
        if parent is not None and not parent.__dict__.get("_frozen", True):
            if self.name not in parent._call_order:
                object.__setattr__(parent, "_call_order", parent._call_order + (self.name,))
        if not self._own_built:
            self._build_now(args, kwargs)
        self._check_x64()
        args, kwargs = self._autocast_inputs(args, kwargs)
        callbacks = [hook(self, args, dict(kwargs)) for hook in _context.hooks()]
        view = self._compute_view()
        if self._call_takes_training:
            kwargs["training"] = training
        with _context.frame(self, training):
            out = view.call(*args, **kwargs)
        for callback in callbacks:
            if callback is not None:
                callback(out)
        return out

    def _build_now(self, args: tuple, kwargs: dict) -> None:
        if self.__dict__.get("_frozen", True) or _context.build_state() is None:
            raise RuntimeError(
                f"{type(self).__name__} {self.path!r} is not built: call "
                "model = model.build(jax.random.key(0), sample_input) first."
            )
        if self._policy_source == _INFER:
            self._policy_source = _infer_policy(self, args, kwargs)
        self._check_x64()
        cast_args, cast_kwargs = self._autocast_inputs(args, kwargs)
        self.build_variables(*cast_args, **cast_kwargs)
        self._own_built = True
        self._after_build()

    def _autocast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.autocast:
            return args, kwargs
        policy = self.dtype_policy
        dtype = jnp.dtype(policy.compute_dtype)

        def leaf(x):
            if _is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
                return jnp.asarray(x).astype(dtype)
            return x

        return jax.tree_util.tree_map(leaf, (args, kwargs))

    def _compute_view(self) -> "Module":
        dtype = jnp.dtype(self.compute_dtype)
        casts = {
            key: jnp.asarray(value).astype(dtype)
            for key, value in self._attrs()
            if _is_array(value)
            and jnp.issubdtype(value.dtype, jnp.floating)
            and value.dtype != dtype
            and key not in self._no_autocast
        }
        if not casts:
            return self
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.__dict__.update(casts)
        return view

    def _check_x64(self) -> None:
        policy = self.dtype_policy
        if not jax.config.jax_enable_x64 and (
            policy.compute_dtype in _X64_DTYPES or policy.variable_dtype in _X64_DTYPES
        ):
            raise ValueError(
                f"{self.path!r} has the policy {policy.name!r}, which needs 64-bit JAX: call "
                "jax.config.update('jax_enable_x64', True) at start-up or use "
                "`with jax.enable_x64(True):`."
            )

    # --- weights ----------------------------------------------------------------------------

    def regularization_loss(self) -> jax.Array:
        """The sum of every layer's regularization penalties, from the stored (variable-dtype)
        values, in float32."""
        total = jnp.zeros((), jnp.float32)
        for module in self.modules().values():
            for name, regularizer in module._regularizers:
                total = total + jnp.asarray(regularizer(getattr(module, name)), jnp.float32)
        return total

    def count_params(self) -> int:
        return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(self)))

    def nbytes(self) -> int:
        """Bytes of every array in the model, in their stored dtypes."""
        return int(sum(np.size(x) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(self)))

    def summary(self) -> str:
        """A table of every leaf layer: path, class, policy, output dtype is the compute dtype."""
        rows = [("path", "layer", "policy", "params", "bytes")]
        for path, layer in self.layers_by_path().items():
            rows.append(
                (path, type(layer).__name__, layer.dtype_policy.name, str(layer.count_params()),
                 str(layer.nbytes()))
            )
        rows.append(("total", "", "", str(self.count_params()), str(self.nbytes())))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    def __repr__(self) -> str:
        state = "built" if self.__dict__.get("_frozen") and self.built else "unbuilt"
        policy = self._policy_source
        shown = policy.name if isinstance(policy, DTypePolicy) else repr(policy)
        return f"<{type(self).__name__} {self.path!r} {shown} {state}>"


Layer = Module


def _compiles_top_level_call(module: Module, args: tuple, kwargs: dict) -> bool:
    """Whether a call from plain Python (not inside a model, a trace, a build, a call hook or an
    rng scope) should run compiled as a whole instead of op by op."""
    if not module.__dict__.get("_frozen", False) or not module._own_built:
        return False
    if _context.caller() is not None or _context.build_state() is not None or _context.hooks():
        return False
    if _context.rng_active():
        return False
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    return bool(leaves) and all(_is_array(x) and not isinstance(x, jax.core.Tracer) for x in leaves)


@functools.partial(jax.jit, static_argnames=("training",))
def _jit_call(module: Module, args: tuple, kwargs: dict, training: bool) -> Any:
    return module(*args, training=training, **kwargs)


def _policy_source(dtype: Any) -> Any:
    if isinstance(dtype, str) and dtype == _INFER:
        import warnings  # pylint: disable=import-outside-toplevel

        warnings.warn(
            "The 'infer' dtype policy (TF 1 behaviour: take the dtype of the first input) is "
            "deprecated; pass dtype='float32' (or the policy you want) instead.",
            DeprecationWarning,
            stacklevel=4,
        )
        return _INFER
    resolved = policies.get(dtype)
    if isinstance(resolved, DTypePolicyMap):
        return FrozenPolicyMap.from_map(resolved)
    return resolved


def _infer_policy(module: Module, args: tuple, kwargs: dict) -> DTypePolicy:
    for leaf in jax.tree_util.tree_leaves((args, kwargs)):
        if _is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.floating):
            return DTypePolicy(jnp.dtype(leaf.dtype).name)
    raise ValueError(f"{module.path!r} uses the 'infer' policy but got no floating-point input.")


def _input_spec(args: tuple, kwargs: dict) -> str:
    """A JSON description of the build inputs (shapes and dtypes), to rebuild a saved model."""
    import json  # pylint: disable=import-outside-toplevel

    def describe(x):
        if _is_array(x):
            return {"shape": list(np.shape(x)), "dtype": jnp.dtype(x.dtype).name}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"value": x}
        raise TypeError(f"build() inputs must be arrays, numbers or None. Received {type(x).__name__}")

    try:
        return json.dumps({
            "args": [jax.tree_util.tree_map(describe, a) for a in args],
            "kwargs": {k: jax.tree_util.tree_map(describe, v) for k, v in kwargs.items()},
        })
    except TypeError:
        return ""


def _check_key(key: Any) -> None:
    ok = isinstance(key, jax.Array) and (
        jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        or (key.dtype == jnp.uint32 and key.shape == (2,))
    )
    if not ok:
        raise TypeError(
            f"build(key, *sample_inputs) needs a PRNG key such as jax.random.key(0) first. "
            f"Received: key={key!r}"
        )


def _mutable_tree(module: Module) -> Module:
    new = module._copy(mutable=True)

    def copy(x):
        return _mutable_tree(x) if isinstance(x, Module) else x

    for key, value in list(new._attrs()):
        if isinstance(value, Module) or (_is_dynamic(value) and not _is_array(value)):
            object.__setattr__(new, key, jax.tree_util.tree_map(copy, value, is_leaf=is_module))
    return new


def _map_modules(module: Module, fn: Callable[[Module], Module | None]) -> Module:
    """Rebuilds the tree bottom-up, replacing each module by ``fn(copy)`` when not None."""
    new = module._copy(mutable=True)

    def visit(x):
        return _map_modules(x, fn) if isinstance(x, Module) else x

    for key, value in list(new._attrs()):
        if isinstance(value, Module) or (_is_dynamic(value) and not _is_array(value)):
            object.__setattr__(new, key, jax.tree_util.tree_map(visit, value, is_leaf=is_module))
    new._freeze()
    replaced = fn(new)
    return new if replaced is None else replaced


def _freeze_tree(module: Module) -> None:
    for child in module._child_items():
        _freeze_tree(child[2])
    module._freeze()


# --- pytree registration (one generic flatten for every subclass) -----------------------------


def _flatten_with_keys(module: Module):
    names = module._child_names
    children = tuple((jax.tree_util.GetAttrKey(n), module.__dict__[n]) for n in names)
    static = tuple((k, v) for k, v in module._attrs() if k not in names)
    return children, (names, static)


def _flatten(module: Module):
    names = module._child_names
    static = tuple((k, v) for k, v in module._attrs() if k not in names)
    return tuple(module.__dict__[n] for n in names), (names, static)


def _unflatten(cls: type) -> Callable:
    def unflatten(aux, children):
        names, static = aux
        obj = object.__new__(cls)
        d = obj.__dict__
        d.update(static)
        d.update(zip(names, children))
        d["_child_names"] = names
        d["_frozen"] = True
        return obj

    return unflatten
