"""Loss scales for float16 training, as immutable pytrees.

float16 gradients underflow (anything below ~6e-8 becomes 0). Multiplying the loss by a large
factor before differentiation lifts them into range; the gradients are divided by the same factor
before the optimizer sees them. A dynamic scale grows while steps stay finite and shrinks on
overflow.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from autopolicy._pytree import pytree_dataclass, replace, set_fields, static_field

__all__ = [
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "LossScale",
    "LOSS_SCALE_CHOICES",
    "parse_loss_scale",
    "all_finite",
    "select_tree",
]


def _check_positive(name: str, value: Any, minimum: float = 0.0, strict: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number. Received: {name}={value!r}")
    ok = value > minimum if strict else value >= minimum
    if not ok or value != value or value == float("inf"):
        relation = ">" if strict else ">="
        raise ValueError(f"{name} must be finite and {relation} {minimum}. Received: {name}={value!r}")
    return float(value)


def _scale_leaf(x: Any, factor: jax.Array) -> Any:
    return (jnp.asarray(x, jnp.float32) * factor).astype(jnp.result_type(x))


def _map_floating(fn, tree: Any) -> Any:
    def leaf(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return fn(x)
        return x

    return jax.tree_util.tree_map(leaf, tree)


class _ScalingMixin:
    loss_scale: jax.Array

    def scale(self, tree: Any) -> Any:
        """Multiplies every floating leaf of ``tree`` (typically the loss) by the loss scale."""
        return _map_floating(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: Any) -> Any:
        """Divides every floating leaf of ``tree`` (typically the gradients) by the loss scale.

        The division happens in float32 and the result is cast back to each leaf's dtype.
        """
        inverse = 1.0 / self.loss_scale
        return _map_floating(lambda x: _scale_leaf(x, inverse), tree)


@pytree_dataclass
class NoOpLossScale(_ScalingMixin):
    """No loss scaling: ``scale`` and ``unscale`` return their input unchanged.

    >>> NoOpLossScale().scale(2.0)
    2.0
    """

    def __init__(self):
        pass

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        return jnp.ones((), jnp.float32)

    def scale(self, tree: Any) -> Any:
        return tree

    def unscale(self, tree: Any) -> Any:
        return tree

    def adjust(self, grads_finite: jax.Array) -> "NoOpLossScale":
        del grads_finite
        return self

    def __repr__(self) -> str:
        return "NoOpLossScale()"


@pytree_dataclass
class StaticLossScale(_ScalingMixin):
    """A fixed loss scale.

    Args:
      scale: The factor, a finite number > 0 (powers of two keep the scaling exact).

    >>> StaticLossScale(128.0).scale(jnp.float32(2.0))
    Array(256., dtype=float32)
    """

    loss_scale: jax.Array

    def __init__(self, scale: float):
        set_fields(self, loss_scale=jnp.asarray(_check_positive("scale", scale), jnp.float32))

    def adjust(self, grads_finite: jax.Array) -> "StaticLossScale":
        del grads_finite
        return self

    def __repr__(self) -> str:
        return f"StaticLossScale({_show(self.loss_scale)})"


@pytree_dataclass
class DynamicLossScale(_ScalingMixin):
    """A loss scale that grows while gradients stay finite and shrinks when they overflow.

    After ``growth_interval`` consecutive finite steps the scale is multiplied by ``factor`` and
    the counter resets; a non-finite step divides it by ``factor`` (never below ``min_scale``)
    and resets the counter.

    Args:
      initial_scale: The starting scale (> 0).
      growth_interval: Consecutive finite steps before growing (an int >= 1).
      factor: Growth and shrink factor (> 1).
      min_scale: The scale never drops below this (> 0).

    >>> s = DynamicLossScale(initial_scale=8.0, growth_interval=2)
    >>> s = s.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))
    >>> float(s.loss_scale)
    16.0
    >>> float(s.adjust(jnp.bool_(False)).loss_scale)
    8.0
    """

    loss_scale: jax.Array
    counter: jax.Array
    growth_interval: int = static_field()
    factor: float = static_field()
    min_scale: float = static_field()

    def __init__(
        self,
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        factor: float = 2.0,
        min_scale: float = 1.0,
    ):
        initial_scale = _check_positive("initial_scale", initial_scale)
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise TypeError(f"growth_interval must be an int. Received: growth_interval={growth_interval!r}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1. Received: growth_interval={growth_interval!r}")
        factor = _check_positive("factor", factor, minimum=1.0)
        min_scale = _check_positive("min_scale", min_scale)
        if initial_scale < min_scale:
            raise ValueError(
                f"initial_scale must be >= min_scale. Received: initial_scale={initial_scale!r}, "
                f"min_scale={min_scale!r}"
            )
        set_fields(
            self,
            loss_scale=jnp.asarray(initial_scale, jnp.float32),
            counter=jnp.zeros((), jnp.int32),
            growth_interval=growth_interval,
            factor=factor,
            min_scale=min_scale,
        )

    def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
        """Returns the loss scale for the next step, given whether this step's grads were finite."""
        grads_finite = jnp.asarray(grads_finite, jnp.bool_)
        counter = self.counter + 1
        grow = counter >= self.growth_interval
        grown = self.loss_scale * self.factor
        # Growing past float32's range would turn the next loss into inf; stay put instead.
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
        finite_scale = jnp.where(grow, grown, self.loss_scale)
        finite_counter = jnp.where(grow, 0, counter)
        shrunk = jnp.maximum(self.loss_scale / self.factor, jnp.float32(self.min_scale))
        return replace(
            self,
            loss_scale=jnp.where(grads_finite, finite_scale, shrunk).astype(jnp.float32),
            counter=jnp.where(grads_finite, finite_counter, 0).astype(jnp.int32),
        )

    def __repr__(self) -> str:
        return (
            f"DynamicLossScale(loss_scale={_show(self.loss_scale)}, counter={_show(self.counter)}, "
            f"growth_interval={self.growth_interval}, factor={self.factor}, "
            f"min_scale={self.min_scale})"
        )


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale

#: What a ``loss_scale`` argument may be (training loops and the TF 2 legacy ``Policy``).
LOSS_SCALE_CHOICES = ("'auto'", "'dynamic'", "None", "a number > 0", "a loss-scale object")


def parse_loss_scale(loss_scale: Any, auto: Callable[[], LossScale]) -> LossScale:
    """The loss scale a ``loss_scale`` argument means.

    Args:
      loss_scale: ``"auto"`` (whatever ``auto()`` decides), ``"dynamic"`` (a default
        :class:`DynamicLossScale`), None (:class:`NoOpLossScale`), a finite number > 0 (a
        :class:`StaticLossScale`), or a loss-scale object (returned as is).
      auto: Called for ``"auto"`` only.

    Raises:
      ValueError: for anything else, naming the value and ``LOSS_SCALE_CHOICES``.

    >>> parse_loss_scale(512, auto=NoOpLossScale)
    StaticLossScale(512.0)
    >>> type(parse_loss_scale("auto", auto=DynamicLossScale)).__name__
    'DynamicLossScale'
    """
    if isinstance(loss_scale, (DynamicLossScale, StaticLossScale, NoOpLossScale)):
        return loss_scale
    if loss_scale is None:
        return NoOpLossScale()
    if isinstance(loss_scale, str) and loss_scale in ("auto", "dynamic"):
        return auto() if loss_scale == "auto" else DynamicLossScale()
    number = isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool)
    if number and math.isfinite(loss_scale) and loss_scale > 0:
        return StaticLossScale(loss_scale)
    raise ValueError(
        f"Invalid loss_scale. Expected one of {LOSS_SCALE_CHOICES}. Received: loss_scale={loss_scale!r}"
    )


def _show(x: Any) -> str:
    try:
        return str(x.item())
    except Exception:  # a tracer inside jit  # pylint: disable=broad-except
        return "<traced>"


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool array: whether every floating leaf of ``tree`` is free of inf and NaN.

    >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
    """
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree_util.tree_leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if not leaves:
        return jnp.array(True)
    return jnp.stack(leaves).all()


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise ``on_true if pred else on_false`` for two trees of the same structure.

    >>> select_tree(jnp.bool_(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})["a"]
    Array([0., 0.], dtype=float32)
    """
    pred = jnp.asarray(pred, jnp.bool_)
    return jax.tree_util.tree_map(lambda a, b: jax.lax.select(pred, a, b), on_true, on_false)
