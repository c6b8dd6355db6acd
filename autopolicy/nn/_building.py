"""Building: one traced pass discovers every layer's input shapes and creates placeholder
weights; the real weights are then drawn outside the trace, and value-dependent conversions
(quantizing) run last."""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy.nn import _context
from autopolicy.nn._base import freeze_tree, is_array, map_modules, mutable_tree
from autopolicy.nn._retyping import INFER, infer_policy

__all__ = ["Building", "input_spec", "check_key"]


class Building:
    """How a module gets its weights (a mixin of ``Module``)."""

    @property
    def built(self) -> bool:
        return self._own_built and all(c.built for c in self.children())

    def build(self, key: jax.Array, *sample_args: Any, **sample_kwargs: Any) -> Any:
        """Returns a built copy: every layer creates its weights from its real input shapes.

        Args:
          key: A ``jax.random.key``; each layer derives its own from it and its path.
          *sample_args: Inputs to run the model on once (any batch size).
          **sample_kwargs: Keyword inputs to run it on, likewise.

        Raises:
          TypeError: if ``key`` is not a PRNG key.
          RuntimeError: if some layers were never called by the model.
        """
        check_key(key)
        spec = input_spec(sample_args, sample_kwargs)
        own_leaves, own_treedef = jax.tree_util.tree_flatten(self)
        input_leaves, input_treedef = jax.tree_util.tree_flatten((sample_args, sample_kwargs))
        traced = [i for i, leaf in enumerate(input_leaves) if is_array(leaf)]
        state = _context.BuildState(key)
        result: dict[str, Any] = {}

        # The pass that discovers shapes runs traced, with zero placeholders for new weights;
        # the weights are drawn afterwards. Traced only, not compiled, when every leaf it
        # returns is a placeholder or one of the model's own arrays passed through (the usual
        # case). A 4-layer MLP built for a new input shape: 104-110 ms -> 9-10 ms on a 2-core Xeon
        # with AVX-512 (its build pass and each weight's cast had compiled;
        # benchmarks/bench_build.py).
        def build_pass(own, arrays):
            inputs = list(input_leaves)
            for i, value in zip(traced, arrays):
                inputs[i] = value
            args, kwargs = jax.tree_util.tree_unflatten(input_treedef, inputs)
            work = mutable_tree(jax.tree_util.tree_unflatten(own_treedef, own))
            with _context.building(state):
                work(*args, **kwargs)
            object.__setattr__(work, "_build_spec", spec)
            freeze_tree(work)
            result["unbuilt"] = [p for p, m in work.modules().items() if not m._own_built]
            leaves, result["treedef"] = jax.tree_util.tree_flatten(work)
            placeholders = {id(p): i for i, (p, _) in enumerate(state.requests)}
            result["requests"] = [(j, placeholders[id(x)]) for j, x in enumerate(leaves) if id(x) in placeholders]
            passed = {id(x): i for i, x in enumerate(own)}
            result["passed"] = [passed.get(id(x)) for x in leaves]
            return leaves

        arrays = [input_leaves[i] for i in traced]
        shapes = jax.eval_shape(build_pass, own_leaves, arrays)
        made = {j for j, _ in result["requests"]}
        if all(i is not None or j in made for j, i in enumerate(result["passed"])):
            leaves = [shape if i is None else own_leaves[i] for shape, i in zip(shapes, result["passed"])]
        else:  # some leaf is computed in the pass (not a weight, not an input): run it (jit
            # reuses eval_shape's trace; were it traced again, its requests index the new ones)
            leaves = list(jax.jit(build_pass)(own_leaves, arrays))
        if result["unbuilt"]:
            raise RuntimeError(
                f"These layers were never called while building, so have no weights: {result['unbuilt']}"
            )
        from autopolicy.nn import initializers  # pylint: disable=import-outside-toplevel

        for leaf_index, request_index in result["requests"]:
            leaves[leaf_index] = initializers.draw(key, **state.requests[request_index][1])
        built = jax.tree_util.tree_unflatten(result["treedef"], leaves)
        return map_modules(built, lambda m: m._finish_build())

    def _finish_build(self) -> Any:
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

    @classmethod
    def _defines_weights(cls) -> bool:
        """Whether the class creates weights of its own (overrides ``build_variables``)."""
        return cls.build_variables is not Building.build_variables

    def _build_now(self, args: tuple, kwargs: dict) -> None:
        if self.__dict__.get("_frozen", True) or _context.build_state() is None:
            raise RuntimeError(
                f"{type(self).__name__} {self.path!r} is not built: call "
                "model = model.build(jax.random.key(0), sample_input) first."
            )
        if self._policy_source == INFER:
            self._policy_source = infer_policy(self, args, kwargs)
        self._check_x64()
        cast_args, cast_kwargs = self._autocast_inputs(args, kwargs)
        self.build_variables(*cast_args, **cast_kwargs)
        self._own_built = True
        self._after_build()


def input_spec(args: tuple, kwargs: dict) -> str:
    """A JSON description of the build inputs (shapes and dtypes), to rebuild a saved model."""
    def describe(x):
        if is_array(x):
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


def check_key(key: Any) -> None:
    ok = isinstance(key, jax.Array) and (
        jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        or (key.dtype == jnp.uint32 and key.shape == (2,))
    )
    if not ok:
        raise TypeError(
            f"build(key, *sample_inputs) needs a PRNG key such as jax.random.key(0) first. "
            f"Received: key={key!r}"
        )
