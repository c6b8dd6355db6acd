"""Loss scaling as an optax wrapper: unscale, skip non-finite steps, adjust the scale."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from autopolicy.numerics.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
)

__all__ = ["LossScaleState", "loss_scale_optimizer", "LossScaleOptimizer", "find_loss_scale_state"]

_LOSS_SCALE_TYPES = (DynamicLossScale, StaticLossScale, NoOpLossScale)


class LossScaleState(NamedTuple):
    """State of :func:`loss_scale_optimizer`: the current loss scale and the inner state."""

    loss_scale: LossScale
    inner_state: Any


def loss_scale_optimizer(
    inner: optax.GradientTransformation, loss_scale: LossScale
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that it can be fed gradients of a loss multiplied by a loss scale.

    ``update`` receives the gradients of ``state.loss_scale.scale(loss)``, divides them by the
    scale, and, when every gradient is finite, applies ``inner``. On a non-finite step it returns
    zero updates and leaves the inner state bit-identical (the step is skipped). Either way the
    loss scale is adjusted.

    Args:
      inner: Any optax transformation (``optax.adam(1e-3)``).
      loss_scale: The initial loss scale: ``DynamicLossScale()``, ``StaticLossScale(s)``...

    Returns:
      A transformation whose state is a :class:`LossScaleState`.

    >>> opt = loss_scale_optimizer(optax.sgd(0.5), StaticLossScale(4.0))
    >>> params = {"w": jnp.ones(2)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": jnp.full(2, 4.0)}, state, params)
    >>> updates["w"]
    Array([-0.5, -0.5], dtype=float32)
    """
    if not isinstance(loss_scale, _LOSS_SCALE_TYPES):
        raise TypeError(
            "loss_scale must be a DynamicLossScale, StaticLossScale or NoOpLossScale. "
            f"Received: loss_scale={loss_scale!r}"
        )
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return LossScaleState(loss_scale, inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        grads = state.loss_scale.unscale(updates)
        finite = all_finite(grads)

        def apply(grads, inner_state):
            return inner.update(grads, inner_state, params, **extra_args)

        def skip(grads, inner_state):
            out = jax.eval_shape(apply, grads, inner_state)
            zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out[0])
            # Same values and bits; only a weak type may differ from what ``apply`` returns.
            kept = jax.tree_util.tree_map(lambda x, s: jnp.asarray(x, s.dtype), inner_state, out[1])
            return zeros, kept

        if isinstance(finite, jax.core.Tracer):
            # A cond, not a select: XLA:CPU fuses a select into the inner update's arithmetic
            # and recomputes it (re-reading every gradient) for each output, doubling the step.
            new_updates, new_inner = jax.lax.cond(finite, apply, skip, grads, state.inner_state)
        else:  # eager: a Python branch, rather than compiling a new cond at every call
            new_updates, new_inner = (apply if bool(finite) else skip)(grads, state.inner_state)
        return new_updates, LossScaleState(state.loss_scale.adjust(finite), new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class LossScaleOptimizer(optax.GradientTransformationExtraArgs):
    """Keras's spelling: a dynamic loss scale around ``inner_optimizer``.

    Args:
      inner_optimizer: The optax transformation to wrap.
      initial_scale: The starting loss scale.
      dynamic_growth_steps: Consecutive finite steps before the scale doubles.

    >>> isinstance(LossScaleOptimizer(optax.adam(1e-3)), optax.GradientTransformation)
    True
    """

    def __new__(
        cls,
        inner_optimizer: optax.GradientTransformation,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
    ):
        steps = dynamic_growth_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"dynamic_growth_steps must be an int >= 1. Received: dynamic_growth_steps={steps!r}"
            )
        wrapped = loss_scale_optimizer(
            inner_optimizer,
            DynamicLossScale(initial_scale=initial_scale, growth_interval=dynamic_growth_steps),
        )
        return super().__new__(cls, wrapped.init, wrapped.update)


def find_loss_scale_state(opt_state: Any) -> LossScaleState | None:
    """The first :class:`LossScaleState` inside an optimizer state (e.g. within a chain)."""
    found = []

    def visit(node):
        if isinstance(node, LossScaleState):
            found.append(node)
            return True
        return False

    jax.tree_util.tree_map(lambda x: x, opt_state, is_leaf=visit)
    return found[0] if found else None
