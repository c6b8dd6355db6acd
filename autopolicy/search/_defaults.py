"""The search's constants, in one place."""

from __future__ import annotations

import math

__all__ = ["REFERENCE", "DEFAULT_CANDIDATES", "BUDGET_TOLERANCE", "within_budget", "worsening", "change_word"]

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


def worsening(baseline: float, metric: float, higher_is_better: bool = True) -> float:
    """How much worse ``metric`` is than ``baseline`` in the metric's direction: its drop when
    higher is better (accuracy), its rise when lower is better (perplexity, loss); negative when
    it is better.

    >>> worsening(0.9, 0.88), worsening(20.0, 21.0, higher_is_better=False), worsening(20.0, 19.0, False)
    (0.020000000000000018, 1.0, -1.0)
    """
    return baseline - metric if higher_is_better else metric - baseline


def change_word(higher_is_better: bool = True) -> str:
    """What a worsening of the metric is called in messages and reports: "drop" or "rise".

    >>> change_word(True), change_word(False)
    ('drop', 'rise')
    """
    return "drop" if higher_is_better else "rise"


def within_budget(baseline: float, metric: float | None, allowed_drop: float, higher_is_better: bool = True) -> bool:
    """Whether ``metric`` is finite and worse than ``baseline`` by at most ``allowed_drop`` in the
    metric's direction (at most that much below it when higher is better, above it when lower is).

    >>> within_budget(0.9, 0.895, 0.01), within_budget(0.9, 0.88, 0.01), within_budget(0.9, float("nan"), 1.0)
    (True, False, False)
    >>> within_budget(20.0, 20.3, 0.4, higher_is_better=False), within_budget(20.0, 20.5, 0.4, higher_is_better=False)
    (True, False)
    """
    return (metric is not None and math.isfinite(metric)
            and worsening(baseline, metric, higher_is_better) <= allowed_drop + BUDGET_TOLERANCE)
