"""The TensorFlow 2 experimental mixed-precision surface, for code written against it.

``Policy(name, loss_scale="auto")`` is a :class:`~autopolicy.policies.DTypePolicy` that also
carries a loss scale; a training loop handed one wraps its optimizer with that scale.
Serialized (Keras JSON), it is a plain ``DTypePolicy``: Keras 3 has no loss scale on policies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autopolicy.numerics.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from autopolicy.policies import DTypePolicy, dtype_policy, set_dtype_policy

__all__ = ["Policy", "set_policy", "global_policy", "LOSS_SCALE_CHOICES"]

LOSS_SCALE_CHOICES = ("'auto'", "'dynamic'", "None", "a number > 0", "a loss-scale object")


def _loss_scale_config(name: str, loss_scale: Any) -> tuple | None:
    """A hashable description of the loss scale, so the policy stays hashable."""
    if isinstance(loss_scale, str):
        if loss_scale == "auto":
            return ("dynamic",) if name == "mixed_float16" else None
        if loss_scale == "dynamic":
            return ("dynamic",)
    elif loss_scale is None or isinstance(loss_scale, NoOpLossScale):
        return None
    elif isinstance(loss_scale, DynamicLossScale):
        return (
            "dynamic",
            float(loss_scale.loss_scale),
            loss_scale.growth_interval,
            loss_scale.factor,
            loss_scale.min_scale,
        )
    elif isinstance(loss_scale, StaticLossScale):
        return ("static", float(loss_scale.loss_scale))
    elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        StaticLossScale(loss_scale)  # validates: finite and > 0
        return ("static", float(loss_scale))
    raise ValueError(
        f"Invalid loss_scale. Expected one of {LOSS_SCALE_CHOICES}. Received: loss_scale={loss_scale!r}"
    )


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
