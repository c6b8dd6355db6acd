"""The search's constants, in one place."""

from __future__ import annotations

import math

__all__ = ["REFERENCE", "DEFAULT_CANDIDATES", "BUDGET_TOLERANCE", "within_budget"]

#: The policy every layer starts from and every figure is compared with.
REFERENCE = "float32"

#: Candidates when none are given: the float policies and the quantized modes that run on every
#: layer kind with a kernel (int4 is opt-in: it trades accuracy for memory).
DEFAULT_CANDIDATES = (
    "float32",
    "mixed_bfloat16",
    "mixed_float16",
    "int8_from_float32",
    "float8_from_float32",
)

#: Slack for comparing a drop with the budget (a drop equal to the budget meets it).
BUDGET_TOLERANCE = 1e-12


def within_budget(baseline: float, metric: float | None, allowed_drop: float) -> bool:
    """Whether ``metric`` (higher is better) is finite and at most ``allowed_drop`` below ``baseline``.

    >>> within_budget(0.9, 0.895, 0.01), within_budget(0.9, 0.88, 0.01), within_budget(0.9, float("nan"), 1.0)
    (True, False, False)
    """
    return metric is not None and math.isfinite(metric) and baseline - metric <= allowed_drop + BUDGET_TOLERANCE
