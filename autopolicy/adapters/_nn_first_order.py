"""The first-order estimate's probes for ``autopolicy.nn`` models: a loss's gradient with respect
to every tunable layer's output, and each layer's output under a candidate policy on the inputs
that pass recorded.

The gradient comes from one compiled backward pass: a call hook adds a zero (a "probe") to the
output of every call of every tunable layer, and the loss is differentiated with respect to
the probes. The same hook returns each call's inputs from the compiled pass, so the layer runs
afterwards on exactly what it saw.

Running 272 layers under four policies would compile 1,088 programs if each layer were its own
program (a layer's name is part of its pytree structure). :class:`LayerRunner` compiles one
program per layer signature and policy instead: a layer's weights are poured into the
structure of the first layer of its signature, whose configuration differs only in the name.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopolicy import policies
from autopolicy.nn import _context
from autopolicy.nn._module import Module
from autopolicy.search.adapter import OutputGradients, cast_floating

__all__ = ["GradientProbe", "LayerRunner"]


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or isinstance(x, jax.core.Tracer)


def _as_args(batch: Any) -> tuple:
    return batch if isinstance(batch, tuple) else (batch,)


def _counting_hook(paths: Sequence[str], on_call: Callable[[str, int, tuple, dict], Any]):
    """A call hook that numbers the calls of the layers at ``paths`` and returns
    ``on_call(path, index, args, kwargs)`` (an output callback, or None)."""
    wanted, counts = set(paths), {}

    def hook(layer: Any, args: tuple, kwargs: dict) -> Any:
        path = getattr(layer, "path", None)
        if path not in wanted:
            return None
        index = counts.get(path, 0)
        counts[path] = index + 1
        return on_call(path, index, args, kwargs)

    return hook


def _output_shapes(model: Module, paths: Sequence[str], loss_fn: Callable, batch: tuple) -> dict[str, list]:
    """``path -> calls -> [ShapeDtypeStruct of each floating output leaf]``, from an abstract pass."""
    shapes: dict[str, list] = {}

    def on_call(path, index, args, kwargs):
        del index, args, kwargs

        def record(out):
            shapes.setdefault(path, []).append([jax.ShapeDtypeStruct(x.shape, x.dtype)
                                                for x in jax.tree_util.tree_leaves(out) if _is_float(x)])

        return record

    def run(model, batch):
        with _context.call_hook(_counting_hook(paths, on_call)):
            return loss_fn(model, *batch)

    jax.eval_shape(run, model, batch)
    return shapes


def _split(tree: Any) -> tuple[list, tuple]:
    """The array leaves of ``tree``, and what rebuilds it from them (its structure and the other
    leaves, which a compiled function cannot return)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [x for x in leaves if _is_array(x)]
    others = tuple(None if _is_array(x) else x for x in leaves)
    return arrays, (treedef, others)


def _join(arrays: Sequence[Any], rebuild: tuple) -> Any:
    treedef, others = rebuild
    it = iter(arrays)
    return jax.tree_util.tree_unflatten(treedef, [next(it) if o is None else o for o in others])


def _check_losses(losses: Any) -> jax.Array:
    losses = jnp.asarray(losses)
    if not jnp.issubdtype(losses.dtype, jnp.floating):
        raise TypeError(f"loss_fn must return floating per-example losses (or their mean). "
                        f"Received {losses.dtype} {losses.shape}")
    return losses.astype(jnp.float32)


class GradientProbe:
    """The gradient of ``mean(loss_fn(model, *batch))`` with respect to the output of every call
    of the layers at ``paths``, and those calls' inputs: one compiled forward and backward pass
    per batch (compiled once per batch shape).

    ``loss_fn`` returns per-example losses (an array whose mean is the loss); a scalar counts the
    batch's leading dimension as its examples.
    """

    def __init__(self, model: Module, paths: Sequence[str], loss_fn: Callable):
        self.model, self.paths, self.loss_fn = model, tuple(paths), loss_fn
        self._shapes: dict[Any, dict[str, list]] = {}
        self._side: dict[str, Any] = {}  # filled while tracing: what the compiled function cannot return
        self._step = jax.jit(jax.value_and_grad(self._loss_with_probes, argnums=1, has_aux=True))

    def _loss_with_probes(self, model: Module, probes: dict, batch: tuple) -> tuple:
        inputs: dict[str, list] = {}

        def on_call(path, index, args, kwargs):
            if index >= len(probes.get(path, ())):
                return None
            inputs.setdefault(path, []).append((args, kwargs))

            def add(out):
                leaves, treedef = jax.tree_util.tree_flatten(out)
                zeros = iter(probes[path][index])
                return jax.tree_util.tree_unflatten(treedef, [x + next(zeros) if _is_float(x) else x for x in leaves])

            return add

        with _context.call_hook(_counting_hook(self.paths, on_call)):
            losses = _check_losses(self.loss_fn(model, *batch))
        first = batch[0] if batch else None
        self._side["examples"] = int(losses.size) if losses.ndim else (int(np.shape(first)[0]) if np.ndim(first) else 1)
        arrays, self._side["inputs"] = _split(inputs)
        return jnp.mean(losses), arrays

    def __call__(self, batch: Any) -> OutputGradients:
        """The gradients on ``batch`` (a tuple of the model's inputs, or one array).

        Raises:
          TypeError: if ``loss_fn`` returns something other than floating values.
          ValueError: if the loss is not finite on the float32 model.
        """
        batch = _as_args(batch)
        signature = str([(np.shape(x), str(getattr(x, "dtype", type(x)))) for x in jax.tree_util.tree_leaves(batch)])
        if signature not in self._shapes:
            self._shapes[signature] = _output_shapes(self.model, self.paths, self.loss_fn, batch)
        probes = {p: [[jnp.zeros(s.shape, s.dtype) for s in call] for call in calls]
                  for p, calls in self._shapes[signature].items()}
        (loss, arrays), grads = self._step(self.model, probes, batch)
        loss = float(loss)
        if not np.isfinite(loss):
            raise ValueError(f"loss_fn gave a non-finite loss ({loss}) on the float32 model: its gradient cannot "
                             "estimate anything.")
        inputs = _join(arrays, self._side["inputs"])
        return OutputGradients(
            loss=loss, examples=self._side["examples"],
            gradients={p: tuple(tuple(call) for call in calls) for p, calls in grads.items()},
            inputs={p: tuple(calls) for p, calls in inputs.items()})


def _run_layer(leaves: list, args: tuple, kwargs: dict, *, treedef: Any) -> list:
    layer = jax.tree_util.tree_unflatten(treedef, leaves)
    out = layer(*args, **kwargs)
    return [x.astype(jnp.float32) for x in jax.tree_util.tree_leaves(out) if _is_float(x)]


class LayerRunner:
    """Runs tunable layers under a policy on recorded inputs, compiling once per (signature,
    policy, weight shapes): a layer is run as the first layer of its signature carrying its own
    weights (equal signatures mean equal configurations but for the name)."""

    def __init__(self, layer_under: Callable[[str, policies.DTypePolicy], Module], signatures: Mapping[str, str]):
        self._layer_under, self._signatures = layer_under, signatures
        self._programs: dict[tuple, Callable] = {}

    def outputs(self, path: str, policy: policies.DTypePolicy, calls: Sequence[tuple]) -> tuple[tuple, ...]:
        """Per call ``(args, kwargs)`` in ``calls``: the floating leaves of the layer's output
        under ``policy`` (its inputs cast to the policy's compute dtype), as float32."""
        layer = self._layer_under(path, policy)  # GPTQ/AWQ weights calibrated by the adapter
        leaves, treedef = jax.tree_util.tree_flatten(layer)
        group = (self._signatures[path], policy.name, tuple((np.shape(x), str(x.dtype)) for x in leaves))
        program = self._programs.get(group)
        if program is None:
            program = jax.jit(lambda leaves, args, kwargs, _t=treedef: _run_layer(leaves, args, kwargs, treedef=_t))
            self._programs[group] = program
        out = []
        for args, kwargs in calls:
            args, kwargs = cast_floating((args, kwargs), policy.compute_dtype)
            out.append(tuple(program(leaves, args, kwargs)))
        return tuple(out)
