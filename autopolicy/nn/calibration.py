"""Post-training calibration of float8 scales."""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp

from autopolicy.nn._module import Module
from autopolicy.nn._partition import combine, partition
from autopolicy.numerics.float8 import overwrite_with_gradient

__all__ = ["calibrate"]


def _keep_output_grad(old: Any, new: Any) -> Any:
    """Calibration measures inputs and kernels; gradient scales only make sense in training."""
    if isinstance(old, dict) and "output_grad" in old:
        return {**new, "output_grad": old["output_grad"]}
    return new


def calibrate(model: Module, batches: Iterable[Any]) -> Module:
    """Sets the float8 input and kernel scales of ``model`` from a few representative batches.

    Each batch is one step of delayed scaling: the amax histories record the batch's absolute
    maxima and the scales follow them. Models without float8 layers come back unchanged. GPTQ
    and AWQ weights are calibrated by :func:`autopolicy.nn.calibrate_weights`.

    Args:
      model: A built model (float8 layers have ``float8_from_*`` policies).
      batches: Inputs to call the model on (arrays, or tuples of positional arguments).

    Returns:
      The calibrated model.
    """
    fp8, rest = partition(model, "fp8")
    if not jax.tree_util.tree_leaves(fp8):
        return model

    @jax.jit
    def step(fp8, rest, args):
        def total(fp8):
            out = combine(fp8, rest)(*args)
            return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree_util.tree_leaves(out))

        grads = jax.grad(total)(fp8)
        updated = overwrite_with_gradient(fp8, grads)
        return jax.tree_util.tree_map(
            _keep_output_grad, fp8, updated, is_leaf=lambda x: isinstance(x, dict) and "output_grad" in x
        )

    count = 0
    for batch in batches:
        args = batch if isinstance(batch, tuple) else (batch,)
        fp8 = step(fp8, rest, args)
        count += 1
    if count == 0:
        raise ValueError("calibrate() needs at least one batch.")
    return combine(fp8, rest)
