"""A small fit/evaluate loop on optax that adds loss scaling when the policy needs it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from autopolicy import mixed_precision, policies
from autopolicy.nn import _context
from autopolicy.nn._module import Module
from autopolicy.nn._partition import combine, partition
from autopolicy.numerics import float8
from autopolicy.numerics.loss_scale import (
    LOSS_SCALE_CHOICES,
    DynamicLossScale,
    NoOpLossScale,
    all_finite,
    parse_loss_scale,
    select_tree,
)
from autopolicy.numerics.optimizer import find_loss_scale_state, loss_scale_optimizer
from autopolicy.train import losses as losses_lib
from autopolicy.train import metrics as metrics_lib

__all__ = ["fit", "evaluate", "predict", "History", "resolve_loss_scale", "LOSS_SCALE_CHOICES"]



@dataclasses.dataclass
class History:
    """What :func:`fit` saw, per epoch (``history["loss"]`` is a list, as in Keras)."""

    epochs: list[dict[str, float]] = dataclasses.field(default_factory=list)
    steps: int = 0
    skipped_steps: int = 0
    loss_scale: float | None = None

    def __getitem__(self, key: str) -> list[float]:
        return [e[key] for e in self.epochs if key in e]


# --- loss scale -------------------------------------------------------------------------------


def _legacy_loss_scale(policy: Any):
    if isinstance(policy, mixed_precision.Policy):
        return policy.loss_scale or NoOpLossScale()
    return None


def resolve_loss_scale(model: Module, loss_scale: Any = "auto"):
    """The loss scale a training run of ``model`` uses (``NoOpLossScale`` for none).

    ``"auto"``: the loss scale of a legacy ``mixed_precision.Policy`` on the model or the global
    policy if there is one; else a dynamic scale when any layer computes in float16 (or the
    global policy is ``mixed_float16``); else none. bfloat16 never needs one.
    """
    return parse_loss_scale(loss_scale, lambda: _auto_loss_scale(model))


def _auto_loss_scale(model: Module):
    module_policies = [m._policy_source for m in model.modules().values()]
    for policy in module_policies + [policies.dtype_policy()]:
        legacy = _legacy_loss_scale(policy)
        if legacy is not None:
            return legacy
    float16 = any(m.compute_dtype == "float16" for m in model.modules().values())
    if float16 or policies.dtype_policy().compute_dtype == "float16":
        return DynamicLossScale()
    return NoOpLossScale()


# --- data -------------------------------------------------------------------------------------


def _as_arrays(data: Any) -> tuple[np.ndarray, np.ndarray] | None:
    if isinstance(data, tuple) and len(data) == 2 and all(isinstance(a, (np.ndarray, jax.Array)) for a in data):
        x, y = data
        if len(x) != len(y):
            raise ValueError(f"Inputs and targets differ in length: {len(x)} != {len(y)}")
        if len(x) == 0:
            raise ValueError("The data is empty.")
        return np.asarray(x), np.asarray(y)
    return None


def _batches(data: Any, batch_size: int, rng: np.random.Generator | None) -> Iterator[tuple[Any, Any]]:
    arrays = _as_arrays(data)
    if arrays is None:
        yield from data
        return
    x, y = arrays
    order = rng.permutation(len(x)) if rng is not None else np.arange(len(x))
    for start in range(0, len(x), batch_size):
        idx = order[start : start + batch_size]
        yield x[idx], y[idx]


def _steps_per_epoch(data: Any, batch_size: int) -> int | None:
    arrays = _as_arrays(data)
    if arrays is not None:
        return math.ceil(len(arrays[0]) / batch_size)
    return len(data) if hasattr(data, "__len__") else None


def _check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int. Received: batch_size={batch_size!r}")
    return batch_size


# --- fit --------------------------------------------------------------------------------------


def _make_step(loss_fn, optimizer: optax.GradientTransformation, scaled: bool):
    @jax.jit
    def step(params, fp8, rest, opt_state, x, y, key):
        def objective(params, fp8):
            model = combine(params, fp8, rest)
            with _context.rng_scope(key):
                predictions = model(x, training=True)
            value = loss_fn(y, predictions) + model.regularization_loss()
            scaled_value = find_loss_scale_state(opt_state).loss_scale.scale(value) if scaled else value
            return scaled_value, value

        (grads, fp8_grads), value = jax.grad(objective, argnums=(0, 1), has_aux=True)(params, fp8)
        finite = all_finite(grads)
        # optax's own arithmetic (e.g. Adam's bias correction) relies on standard promotion;
        # keep it working when a user (or a test harness) turns on strict promotion.
        with jax.numpy_dtype_promotion("standard"):
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if scaled:  # a skipped step leaves the parameters bit-identical
            new_params = select_tree(finite, new_params, params)
        new_fp8 = float8.overwrite_with_gradient(fp8, fp8_grads)
        return new_params, new_fp8, new_opt_state, value, finite

    return step


def fit(
    model: Module,
    optimizer: optax.GradientTransformation,
    loss: Any,
    train_data: Any,
    epochs: int = 1,
    batch_size: int = 32,
    validation_data: Any = None,
    metrics: Sequence[Any] = (),
    loss_scale: Any = "auto",
    seed: int = 0,
    shuffle: bool = True,
    progress: bool = True,
) -> tuple[Module, History]:
    """Trains ``model`` and returns ``(trained_model, history)``.

    Args:
      model: A built model.
      optimizer: Any optax transformation. Loss scaling wraps it when needed (see
        :func:`resolve_loss_scale`); one that already scales (``LossScaleOptimizer``) is kept.
      loss: A loss name (``"sparse_categorical_crossentropy"``) or ``fn(targets, predictions)``.
      train_data: ``(x, y)`` NumPy/JAX arrays, or an iterable of ``(x, y)`` batches (iterated
        once per epoch).
      epochs: Passes over the data.
      batch_size: Batch size for array data.
      validation_data: Optional ``(x, y)`` evaluated after every epoch.
      metrics: Metric names or functions for the validation data.
      loss_scale: ``"auto"``, ``"dynamic"``, a number, a loss-scale object, or None (off).
      seed: Seeds shuffling and dropout.
      shuffle: Shuffle array data every epoch.
      progress: Show a progress bar (on a terminal; elsewhere one line to stderr when fit ends).

    Float8 layers update their amax histories and scales every step (they are not touched by the
    optimizer or the loss scale). The history records the loss scale and skipped steps.
    """
    if not isinstance(model, Module) or not model.built:
        raise ValueError("fit() needs a built model: model = model.build(jax.random.key(0), x[:1])")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive int. Received: epochs={epochs!r}")
    batch_size = _check_batch_size(batch_size)
    loss_fn = losses_lib.get(loss)
    metric_fns = [(m if isinstance(m, str) else getattr(m, "__name__", "metric"), metrics_lib.get(m)) for m in metrics]
    scale = resolve_loss_scale(model, loss_scale)
    params, rest = partition(model, "param")
    fp8, rest = partition(rest, "fp8")
    opt_state = optimizer.init(params)
    # An optimizer that already scales (LossScaleOptimizer) is used as it is: wrapping it again
    # would unscale its gradients twice.
    scaled = find_loss_scale_state(opt_state) is not None
    if scaled and not (isinstance(loss_scale, str) and loss_scale == "auto"):
        raise ValueError(
            "The optimizer already applies a loss scale; leave loss_scale='auto'. "
            f"Received: loss_scale={loss_scale!r}"
        )
    if not scaled and not isinstance(scale, NoOpLossScale):
        optimizer = loss_scale_optimizer(optimizer, scale)
        opt_state, scaled = optimizer.init(params), True
    step = _make_step(loss_fn, optimizer, scaled)
    rng = np.random.default_rng(seed)
    base_key = jax.random.key(seed)
    history = History()
    bar = _progress(progress, epochs, _steps_per_epoch(train_data, batch_size))
    try:
        for epoch in range(epochs):
            total, count, skipped = 0.0, 0, 0
            for x, y in _batches(train_data, batch_size, rng if shuffle else None):
                key = jax.random.fold_in(base_key, history.steps)
                params, fp8, opt_state, value, finite = step(params, fp8, rest, opt_state, x, y, key)
                history.steps += 1
                if scaled and not bool(finite):
                    skipped += 1
                else:
                    total, count = total + float(value), count + 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(epoch=epoch + 1, loss=f"{total / max(count, 1):.4f}")
            if count + skipped == 0:
                raise ValueError(f"train_data yielded no batches in epoch {epoch + 1}.")
            record: dict[str, float] = {"loss": total / count if count else float("nan"), "skipped_steps": skipped}
            history.skipped_steps += skipped
            if scaled:
                record["loss_scale"] = float(find_loss_scale_state(opt_state).loss_scale.loss_scale)
                history.loss_scale = record["loss_scale"]
            if validation_data is not None:
                current = combine(params, fp8, rest)
                scores = evaluate(current, validation_data, [f for _, f in metric_fns], loss=loss_fn)
                record["val_loss"] = scores["loss"]
                for (name, _), value in zip(metric_fns, scores["metrics"]):
                    record[f"val_{name}"] = value
            history.epochs.append(record)
    finally:
        if bar is not None:
            bar.close()
    return combine(params, fp8, rest), history


def _progress(enabled: bool, epochs: int, steps: int | None):
    from autopolicy._progress import progress_bar  # pylint: disable=import-outside-toplevel

    return progress_bar(enabled, None if steps is None else epochs * steps, "fit", unit="step")


# --- evaluate / predict -----------------------------------------------------------------------


@jax.jit
def _forward(model: Module, x: jax.Array) -> jax.Array:
    return model(x, training=False)


def predict(model: Module, x: Any, batch_size: int = 256) -> np.ndarray:
    """The model's outputs on ``x``, batch by batch, as one NumPy array."""
    batch_size = _check_batch_size(batch_size)
    x = np.asarray(x)
    outs = [np.asarray(_forward(model, x[i : i + batch_size])) for i in range(0, len(x), batch_size)]
    return np.concatenate(outs)


def evaluate(
    model: Module,
    data: Any,
    metrics: Sequence[Any] = ("accuracy",),
    loss: Any = None,
    batch_size: int = 256,
) -> dict[str, Any]:
    """Scores ``model`` on ``data`` (``(x, y)`` arrays or an iterable of batches).

    Returns:
      ``{"metrics": [one float per metric], "loss": float or None, <metric name>: float}``.
    """
    batch_size = _check_batch_size(batch_size)
    targets, predictions = [], []
    for x, y in _batches(data, batch_size, None):
        predictions.append(np.asarray(_forward(model, x)))
        targets.append(np.asarray(y))
    if not predictions:
        raise ValueError("evaluate() got no data.")
    y_all, p_all = np.concatenate(targets), np.concatenate(predictions)
    out: dict[str, Any] = {"metrics": []}
    for m in metrics:
        value = metrics_lib.get(m)(y_all, p_all)
        out["metrics"].append(value)
        out[m if isinstance(m, str) else getattr(m, "__name__", "metric")] = value
    fn = losses_lib.get(loss) if loss is not None else None
    out["loss"] = float(fn(jnp.asarray(y_all), jnp.asarray(p_all))) if fn is not None else None
    return out
