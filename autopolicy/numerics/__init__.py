"""Numerics that know nothing of layers: loss scales and loss-scaling optimizers."""

from autopolicy.numerics.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from autopolicy.numerics.optimizer import (
    LossScaleOptimizer,
    LossScaleState,
    find_loss_scale_state,
    loss_scale_optimizer,
)

__all__ = [
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "LossScale",
    "all_finite",
    "select_tree",
    "LossScaleState",
    "loss_scale_optimizer",
    "LossScaleOptimizer",
    "find_loss_scale_state",
]
