"""The module base: immutable pytrees with Keras-like construction, names, paths and policies.

A module's arrays and submodules are pytree children; everything else (its name, path, dtype
policy, configuration) is static. A module is frozen once its ``__init__`` returns: a change (a
new policy, quantized weights, trained parameters) returns a new module. Names are given by the
parent: an unnamed child is named after its attribute (``self.query = ...`` -> ``query``) or,
inside a list, after its class (``dense``, ``dense_1``, ...).

The parts live in their own modules: names and paths (``_naming``), policies and retyping
(``_retyping``), building (``_building``); this one holds construction, immutability, the pytree
registration and calling.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, ClassVar, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.nn import _base, _config, _context, _parts
from autopolicy.nn._base import BOOKKEEPING, ModuleBase, is_array, is_dynamic, is_module
from autopolicy.nn._building import Building
from autopolicy.nn._naming import Naming
from autopolicy.nn._retyping import Retyping, policy_source
from autopolicy.policies import DTypePolicy

__all__ = ["Module", "Layer", "is_module"]

_X64_DTYPES = ("float64", "int64", "uint64")

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


class Module(Naming, Retyping, Building, ModuleBase, metaclass=_ModuleMeta):
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
        self._policy_source = policy_source(dtype)
        self._own_built = not self._defines_weights()
        self._weights_mode = None
        self._nontrainable: tuple[str, ...] = ()
        self._no_autocast: tuple[str, ...] = ()
        self._regularizers: tuple[tuple[str, Any], ...] = ()
        self._call_order: tuple[str, ...] = ()

    @classmethod
    def _class_default_name(cls) -> str:
        return cls.default_name or _base.snake_case(cls.__name__)

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
            if key not in BOOKKEEPING:
                yield key, value

    def _freeze(self) -> None:
        child_names = []
        for key, value in self._attrs():
            if is_dynamic(value):
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
        self.__dict__.pop("_aux", None)
        object.__setattr__(self, "_frozen", True)

    def _copy(self, mutable: bool = False, **changes: Any) -> "Module":
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        new.__dict__["_frozen"] = False
        new.__dict__.pop("_aux", None)  # the copy's attributes may change: its aux data is its own
        if not mutable:
            new._freeze()
        return new

    # --- pytree -------------------------------------------------------------------------------

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_with_keys(cls, _base.flatten_with_keys, _base.unflatten_for(cls), _base.flatten)
        cls._call_takes_training = "training" in inspect.signature(cls.call).parameters
        if cls.__module__.startswith("autopolicy."):
            _config.register(cls)
    # --- calling -----------------------------------------------------------------------------

    def call(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement call()")

    def __call__(self, *args: Any, training: bool | None = None, **kwargs: Any) -> Any:
        if _compiles_top_level_call(self, args, kwargs) and not self.compiles_by_parts:
            return _jit_call(self, args, kwargs, training=bool(training))
        if training is None:
            training = _context.inherited_training()
        parent = _context.caller()
        if parent is not None and parent.compiles_by_parts and _parts.compiles_part(self, args, kwargs):
            return _parts.call_part(self, args, kwargs, bool(training), parent)
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
                replaced = callback(out)
                if replaced is not None:  # a hook may stand in for the output (the search's probes)
                    out = replaced
        return out

    def compiled_by_parts(self, by_parts: bool = True, reuse: "_parts.PartOutputs | None" = None) -> "Module":
        """A copy that, called from Python, compiles each child it calls on its own instead of
        compiling the whole call: children that differ only in their names and paths (the blocks
        of a transformer) share one compilation. Models that differ in one layer then compile
        only the parts that differ, where a whole-model compilation each would compile them all
        (the search's per-layer sensitivity scores hundreds of such models).

        The outputs are those of the whole call up to rounding (XLA fuses across a part's edges
        no more); operations of this module's own ``call`` between its children run one by one.

        Args:
          by_parts: False: a copy compiled as a whole again.
          reuse: A :class:`~autopolicy.nn.PartOutputs` shared by models that run the same parts
            on the same inputs (the float32 blocks before the one layer a candidate changes):
            a part that another model sharing it called with the same weights (the same arrays)
            and equal inputs returns its earlier outputs instead of running.
        """
        new = self._copy(mutable=True)
        for key in ("_by_parts", "_part_outputs"):
            new.__dict__.pop(key, None)
        if by_parts:
            object.__setattr__(new, "_by_parts", True)
            if reuse is not None:
                if not isinstance(reuse, _parts.PartOutputs):
                    raise TypeError(f"reuse must be an autopolicy.nn.PartOutputs or None. Received: {reuse!r}")
                object.__setattr__(new, "_part_outputs", reuse)
        new._freeze()
        return new

    @property
    def compiles_by_parts(self) -> bool:
        """Whether a call from Python compiles each child on its own (:meth:`compiled_by_parts`)."""
        return bool(self.__dict__.get("_by_parts", False))

    def _autocast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.autocast:
            return args, kwargs
        policy = self.dtype_policy
        dtype = jnp.dtype(policy.compute_dtype)

        def leaf(x):
            if is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
                return jnp.asarray(x).astype(dtype)
            return x

        return jax.tree_util.tree_map(leaf, (args, kwargs))

    def _compute_view(self) -> "Module":
        dtype = jnp.dtype(self.compute_dtype)
        casts = {
            key: jnp.asarray(value).astype(dtype)
            for key, value in self._attrs()
            if is_array(value)
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
    return bool(leaves) and all(is_array(x) and not isinstance(x, jax.core.Tracer) for x in leaves)


@functools.partial(jax.jit, static_argnames=("training",))
def _jit_call(module: Module, args: tuple, kwargs: dict, training: bool) -> Any:
    return module(*args, training=training, **kwargs)


def lower_call(module: Module, *args: Any, training: bool | None = None, **kwargs: Any) -> Any:
    """The ``jax.stages.Lowered`` of ``module(*args, training=training, **kwargs)`` called from
    Python, where that call runs compiled as a whole: compiling it (in any thread) leaves the call
    its executable, as JAX keeps one per lowering."""
    return _jit_call.lower(module, args, kwargs, training=bool(training))

