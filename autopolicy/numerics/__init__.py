"""Numerics that know nothing of layers: loss scales, loss-scaling optimizers, and the int8,
float8 and int4 quantizers and kernels (per mode in :mod:`autopolicy.numerics.modes`)."""

from autopolicy.numerics.loss_scale import (
    LOSS_SCALE_CHOICES,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    parse_loss_scale,
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
    "LOSS_SCALE_CHOICES",
    "parse_loss_scale",
    "all_finite",
    "select_tree",
    "LossScaleState",
    "loss_scale_optimizer",
    "LossScaleOptimizer",
    "find_loss_scale_state",
]
