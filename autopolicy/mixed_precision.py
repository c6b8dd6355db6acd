"""The TensorFlow 2 experimental mixed-precision surface, for code written against it.

``Policy(name, loss_scale="auto")`` is a :class:`~autopolicy.policies.DTypePolicy` that also
carries a loss scale; a training loop handed one wraps its optimizer with that scale.
Serialized (Keras JSON), it is a plain ``DTypePolicy``: Keras 3 has no loss scale on policies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autopolicy.numerics.loss_scale import (
    LOSS_SCALE_CHOICES,
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    parse_loss_scale,
)
from autopolicy.policies import DTypePolicy, dtype_policy, set_dtype_policy

__all__ = ["Policy", "set_policy", "global_policy", "LOSS_SCALE_CHOICES"]


def _loss_scale_config(name: str, loss_scale: Any) -> tuple | None:
    """A hashable description of the loss scale, so the policy stays hashable."""
    # TF 2's "auto": dynamic for mixed_float16, none otherwise.
    auto = DynamicLossScale if name == "mixed_float16" else NoOpLossScale
    scale = parse_loss_scale(loss_scale, auto)
    if isinstance(scale, DynamicLossScale):
        return ("dynamic", float(scale.loss_scale), scale.growth_interval, scale.factor, scale.min_scale)
    if isinstance(scale, StaticLossScale):
        return ("static", float(scale.loss_scale))
    return None


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Policy(DTypePolicy):
    """TF 2's ``mixed_precision.experimental.Policy``: a dtype policy with a loss scale.

    Args:
      name: A non-quantized policy name (``"mixed_float16"``).
      loss_scale: ``"auto"`` (dynamic for ``mixed_float16``, none otherwise), ``"dynamic"``, a
        number (a fixed scale), None (no scaling), or a loss-scale object.

    >>> Policy("mixed_float16").loss_scale.growth_interval
    2000
    >>> Policy("mixed_bfloat16").loss_scale is None
    True
    """

    loss_scale_config: tuple | None

    def __init__(self, name: str, loss_scale: Any = "auto"):
        super().__init__(name)
        object.__setattr__(self, "loss_scale_config", _loss_scale_config(self.name, loss_scale))

    @property
    def loss_scale(self) -> DynamicLossScale | StaticLossScale | None:
        """A fresh loss-scale object in its initial state, or None."""
        config = self.loss_scale_config
        if config is None:
            return None
        if config[0] == "static":
            return StaticLossScale(config[1])
        return DynamicLossScale(*config[1:])

    def __repr__(self) -> str:
        return f'<Policy "{self.name}", loss_scale={self.loss_scale!r}>'


def set_policy(policy: Any) -> None:
    """TF 2's name for :func:`autopolicy.policies.set_dtype_policy`."""
    set_dtype_policy(policy)


def global_policy() -> DTypePolicy:
    """TF 2's name for :func:`autopolicy.policies.dtype_policy`."""
    return dtype_policy()
